"""Histories that chat templates rewrite (issue 38 item 6; ARCHITECTURE §9).

A chat turn computes the prompt the template rendered plus the tokens the model wrote. On the next turn the client
sends the conversation back, and the template renders that same history again — but not always as the tokens that
were computed: Qwen3-style templates drop an earlier assistant turn's `<think>` reasoning, and templates re-serialise
tool calls in their own JSON spacing. From the first rewritten token on, the next turn misses the cache.

After a chat response whose history may be rewritten (the request had tools, or its output had reasoning), the
server renders the conversation as the next turn will (the messages plus the assistant message as returned, no
generation prompt) and compares it with the tokens computed. Where they differ it queues the canonical rendering as
a prefix-only request (max_new_tokens 0) at IDLE_PRIORITY: the engine admits it only in a step with no other work
(scheduler/planner.py), so it never delays a real request, and the next turn hits its whole history. It keeps the
request's tenant (the context), salt and session. The engine counts these requests and their computed tokens
(`num_prefix_only_requests`, `num_prefix_only_computed`), /metrics also the rewrites detected.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

from ..scheduler.fair_share import IDLE_PRIORITY
from ..scheduler.req import GenerateResult
from ..scheduler.sampling_params import SamplingParams
from .engine_client import Job
from .errors import APIError

logger = logging.getLogger(__name__)

PREFETCH_TIMEOUT_S = 60.0  # an idle-only request that found no idle step by then is dropped
_KEPT = ("cache_salt", "cache_salt_after", "session_id")  # sampling fields the prefetch shares with its turn
_tasks: set[asyncio.Task] = set()  # running prefetches (a task needs a reference until it ends)


def after_chat_turn(state: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    template_kwargs: dict[str, Any], prompt_ids: list[int], result: GenerateResult,
                    message_of: Callable[[], dict[str, Any]], sampling: dict[str, Any]) -> None:
    """Called with a chat turn's first choice once it is complete (streamed or not); `message_of` builds its
    assistant message. Starts a background check when the history may be rewritten (tools, or a reasoning parser)
    and returns at once: the message and the render are made in a worker thread, off the event loop."""
    if not (tools or state.reasoning is not None) or result.cut_short:
        return
    kept = {k: sampling[k] for k in _KEPT if sampling.get(k) is not None}
    computed = list(prompt_ids) + list(result.output_ids)
    task = asyncio.ensure_future(_prefetch(state, messages, message_of, tools, template_kwargs, computed, kept))
    _tasks.add(task)
    task.add_done_callback(_tasks.discard)


def rewritten_history(canonical: list[int], computed: list[int]) -> bool:
    """Whether the next turn's rendering of the history leaves the computed tokens before its end (a rewrite)."""
    common = 0
    for a, b in zip(canonical, computed):
        if a != b:
            break
        common += 1
    return common < min(len(canonical), len(computed)) - 1  # the last computed token's KV is never cached


async def _prefetch(state: Any, messages: list[dict[str, Any]], message_of: Callable[[], dict[str, Any]],
                    tools: Any, template_kwargs: dict[str, Any], computed: list[int], kept: dict[str, Any]) -> None:
    canonical = await asyncio.to_thread(_canonical, state, messages, message_of, tools, template_kwargs)
    if canonical is None or not rewritten_history(canonical, computed):
        return
    state.metrics.history_rewrites += 1
    try:
        lease = state.client.reserve(1, param=None)
    except APIError:
        return  # at capacity: the real work comes first
    params = SamplingParams(max_new_tokens=0, priority=IDLE_PRIORITY, **kept)
    job = Job(prompt_ids=canonical, params=params, rid=state.new_id("prefetch"), param_names={})
    try:
        sub = await state.client.submit([job], lease, stream=False)
    except APIError as exc:
        logger.info("history prefetch refused: %s", exc)
        return
    try:
        await asyncio.wait_for(sub.results(), PREFETCH_TIMEOUT_S)
    except (asyncio.TimeoutError, APIError):
        pass
    finally:
        sub.close()


def _canonical(state: Any, messages: list[dict[str, Any]], message_of: Callable[[], dict[str, Any]], tools: Any,
               template_kwargs: dict[str, Any]) -> list[int] | None:
    """The conversation with the turn's answer as the next turn renders it, or None when no rewrite is possible (no
    tools and no reasoning in the answer) or the template cannot render it without a generation prompt."""
    message = message_of()
    if not (tools or message.get("reasoning_content")):
        return None
    try:
        return state.render_chat([*messages, _as_sent_back(message)], tools, False, **template_kwargs)
    except APIError:
        return None


def _as_sent_back(message: dict[str, Any]) -> dict[str, Any]:
    """The assistant message as a client sends it back (the openai SDK's message, null fields dropped)."""
    return {k: v for k, v in message.items() if v is not None and k != "reasoning"}
