"""Where a request's cache salt starts (issue 41 item 4; README "Tenants").

`cache_salt` makes a request's KV private to the salt (SamplingParams.cache_salt). `cache_salt_after` marks where
the privacy starts: a prompt token count, or `"system"` (chat, Messages) / `"instructions"` (Responses): the end of
the leading system messages as the template renders them. Tokens before it are shared with everyone, so tenants
share a common system prompt's KV and nothing after it (the engine keys the private tokens apart: Req.tree_ids).

`--tenant-salt after-system` does the same without the client's help: on a server with API keys every request is
salted with its tenant from the end of its system message on (a whole-prompt API, completions or /generate, has
none: its whole prompt is the tenant's). A client's own salt then applies inside its tenant's, from the earlier of
the two boundaries.
"""
from __future__ import annotations

import asyncio
from typing import Any, Callable

from .errors import APIError, bad_request
from .tenants import current
SYSTEM_BOUNDARIES = ("system", "instructions")  # the names cache_salt_after accepts for "the system part"
_SYSTEM_ROLES = ("system", "developer")


def read_salt_after(value: Any, param: str = "cache_salt_after") -> int | str | None:
    """The client's cache_salt_after: None, an integer >= 0, or the system boundary's name."""
    if value is None or value in SYSTEM_BOUNDARIES:
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise bad_request(f"{param} must be a token count (an integer >= 0) or \"system\", got {value!r}", param)
    return value


def system_boundary(state: Any, messages: list[dict[str, Any]], tools: Any, template_kwargs: dict[str, Any],
                    prompt_ids: list[int]) -> int:
    """Prompt tokens up to the end of the leading system messages: their rendering alone, as far as it is a prefix
    of the prompt (0 with no system message, or a template that cannot render them alone)."""
    leading = []
    for message in messages:
        if message.get("role") not in _SYSTEM_ROLES:
            break
        leading.append(message)
    if not leading:
        return 0
    try:
        ids = state.render_chat(leading, tools, False, **template_kwargs)
    except APIError:
        return 0
    common = 0
    for a, b in zip(ids, prompt_ids):
        if a != b:
            break
        common += 1
    return common


def _needs_boundary(state: Any, sampling: dict[str, Any]) -> bool:
    return sampling.get("cache_salt_after") in SYSTEM_BOUNDARIES or (
        getattr(state.config, "tenant_salt", "none") == "after-system" and state.tenants.keyed)


async def system_boundary_of(state: Any, sampling: dict[str, Any], messages: list[dict[str, Any]], tools: Any,
                             template_kwargs: dict[str, Any], prompt_ids: list[int]) -> Callable[[], int]:
    """The prompt's system boundary for `resolve_salt`, rendered in a worker thread (as every chat render is) and
    only when this request's salt needs it."""
    if not _needs_boundary(state, sampling):
        return lambda: 0  # never asked for
    value = await asyncio.to_thread(system_boundary, state, messages, tools, template_kwargs, prompt_ids)
    return lambda: value


def resolve_salt(state: Any, sampling: dict[str, Any], boundary: Callable[[], int] | None) -> None:
    """Sets the SamplingParams salt fields in `sampling` from the client's (cache_salt, cache_salt_after) and the
    server's --tenant-salt. `boundary`: the system boundary of this prompt, computed on demand; None for APIs whose
    prompt has no system part."""
    after = read_salt_after(sampling.pop("cache_salt_after", None))
    salt = sampling.get("cache_salt")
    if after in SYSTEM_BOUNDARIES:
        if boundary is None:
            raise bad_request(f"cache_salt_after \"{after}\" needs a system part: use a token count here",
                              "cache_salt_after")
        after = boundary()
    if after is not None and salt is None:
        raise bad_request("cache_salt_after needs a cache_salt", "cache_salt_after")
    if getattr(state.config, "tenant_salt", "none") == "after-system" and state.tenants.keyed:
        own = (0 if after is None else after) if salt is not None else None  # where the client's salt starts
        system = boundary() if boundary is not None else 0
        after = system if own is None else min(own, system)
        salt = f"tenant:{current().name}" + (f"/{salt}" if salt is not None else "")
    sampling["cache_salt"] = salt
    if after:  # 0: the whole prompt is salted, as a plain cache_salt
        sampling["cache_salt_after"] = after
