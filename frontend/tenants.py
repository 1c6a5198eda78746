"""Tenants: who a request's API key belongs to (issue 41; README "Tenants", ARCHITECTURE §9).

`--api-keys FILE` maps each key to a tenant, in JSON or TOML (Python 3.11's tomllib):

    {"sk-acme-1": {"tenant": "acme", "weight": 2, "limits": {"max_running_requests": 4, "max_queued_requests": 8,
                                                          "tokens_per_minute": 200000, "max_kv_share": 0.5}},
     "sk-ops":    {"tenant": "ops", "admin": true}}

A tenant's weight is its fair share in the engine (scheduler/fair_share.py); its limits are enforced by
frontend/tenant_limits.py (max_running_requests also by the engine's admission). Several keys may name one tenant
(they must agree on its weight and limits); `admin` is per key. The single `--api-key` is an admin key of the
tenant "default"; with no key at all every request is the default tenant's, as an admin (the server is open).

A presented key (`Authorization: Bearer KEY` or `x-api-key: KEY`) is hashed and its digest looked up, so no
comparison runs over the key itself; keys are never logged, and a bad entry is named by its position.
The tenant of the request being served is held in a context variable (`current()`), set once by the server's
endpoint wrapper: admission, the engine request and the ownership checks read it from there.
"""
from __future__ import annotations

import contextvars
import hashlib
import json
import math
import os
from dataclasses import dataclass, field, fields, replace
from typing import Any, Mapping

from .errors import APIError
from ..scheduler.checks import MAX_SESSION_ID
from ..scheduler.fair_share import DEFAULT_TENANT

_ENTRY_FIELDS = ("tenant", "weight", "admin", "limits")
MAX_TENANT_NAME = 64  # a scoped session id (engine_session) stays within the engine's limit


@dataclass(frozen=True)
class TenantLimits:
    """Per tenant, None: no limit of the tenant's own (the server's still apply)."""

    max_running_requests: int | None = None  # running in the engine at once (the engine's admission holds the rest)
    max_queued_requests: int | None = None  # admitted beyond that before 429
    tokens_per_minute: int | None = None  # prompt + completion tokens over the last 60 s
    max_kv_share: float | None = None  # of the KV pool held by the tenant's running requests, in (0, 1]

    def __post_init__(self) -> None:
        for name in ("max_running_requests", "max_queued_requests", "tokens_per_minute"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < (0 if name == "max_queued_requests" else 1)):
                low = 0 if name == "max_queued_requests" else 1
                raise ValueError(f"limits.{name} must be an integer >= {low}, got {value!r}")
        share = self.max_kv_share
        if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float))
                                  or not 0 < share <= 1):
            raise ValueError(f"limits.max_kv_share must be a number in (0, 1], got {share!r}")


@dataclass(frozen=True)
class Tenant:
    name: str = DEFAULT_TENANT
    weight: float = 1.0
    admin: bool = False
    limits: TenantLimits = field(default_factory=TenantLimits)


OPEN = Tenant(admin=True)  # no keys configured: everyone is the default tenant, as an admin
_CURRENT: contextvars.ContextVar[Tenant] = contextvars.ContextVar("radixserve_tenant", default=OPEN)


def current() -> Tenant:
    """The tenant of the request being served (OPEN outside a request, or on a server without keys)."""
    return _CURRENT.get()


def enter(tenant: Tenant) -> None:
    """Make `tenant` the current one for the rest of this request's task (the endpoint wrapper calls it)."""
    _CURRENT.set(tenant)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


class Tenants:
    """The keys of a server and their tenants; `authenticate` resolves a request's key."""

    def __init__(self, by_digest: Mapping[bytes, Tenant] | None = None) -> None:
        self._by_digest = dict(by_digest or {})

    @classmethod
    def from_config(cls, api_key: str | None, api_keys: str | None) -> "Tenants":
        """The single --api-key (admin, tenant "default") and the --api-keys file; ValueError naming a bad entry."""
        by_digest = load_keys_file(api_keys) if api_keys is not None else {}
        if api_key is not None:
            if _digest(api_key) in by_digest:
                raise ValueError("--api-key is also a key in --api-keys; give it once")
            default = next((t for t in by_digest.values() if t.name == DEFAULT_TENANT), Tenant())
            by_digest[_digest(api_key)] = replace(default, admin=True)
        return cls(by_digest)

    @property
    def keyed(self) -> bool:
        return bool(self._by_digest)

    def tenants(self) -> dict[str, Tenant]:
        """One Tenant per name (an admin key's copy aside, the keys of a tenant agree)."""
        return {t.name: t for t in self._by_digest.values()}

    def engine_settings(self) -> dict[str, dict[str, Any]]:
        """What the engine applies once at start (Engine.set_tenants): weight and running cap per tenant."""
        return {name: {"weight": t.weight, "max_running_requests": t.limits.max_running_requests}
                for name, t in self.tenants().items()}

    def authenticate(self, headers: Mapping[str, str]) -> Tenant:
        """The tenant of `Authorization: Bearer KEY` (OpenAI's clients) or `x-api-key: KEY` (Anthropic's); 401
        when keys are configured and neither header holds one."""
        if not self._by_digest:
            return OPEN
        scheme, _, bearer = headers.get("authorization", "").partition(" ")
        for token in (bearer if scheme.lower() == "bearer" else "", headers.get("x-api-key", "")):
            token = token.strip()
            tenant = self._by_digest.get(_digest(token)) if token else None
            if tenant is not None:
                return tenant
        raise APIError(401, "missing or invalid API key (send Authorization: Bearer <key>, or x-api-key: <key>)",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def require_admin(tenant: Tenant, what: str) -> None:
    """403 unless the request's key is an admin key."""
    if not tenant.admin:
        raise APIError(403, f"{what} needs an admin API key (a key marked \"admin\": true in --api-keys)",
                       code="admin_required")


# -- the keys file ------------------------------------------------------------------------------


def load_keys_file(path: str) -> dict[bytes, Tenant]:
    """Key digest -> Tenant from a JSON or TOML file; ValueError (one line, no key in it) on anything wrong."""
    where = f"--api-keys {path!r}"
    if not os.path.isfile(path):
        raise ValueError(f"{where} is not a file")
    raw = _parse(path, where)
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"{where} must map API keys to entries ({{\"KEY\": {{\"tenant\": NAME, ...}}}}), and none "
                         "are given")
    by_digest: dict[bytes, Tenant] = {}
    by_name: dict[str, tuple[int, Tenant]] = {}
    for index, (key, entry) in enumerate(raw.items(), start=1):
        try:
            tenant = _entry(key, entry)
        except ValueError as exc:
            raise ValueError(f"{where}: entry {index}: {exc}") from None
        first = by_name.setdefault(tenant.name, (index, tenant))
        if (first[1].weight, first[1].limits) != (tenant.weight, tenant.limits):
            raise ValueError(f"{where}: entry {index} (tenant {tenant.name!r}) gives another weight or limits than "
                             f"entry {first[0]} of the same tenant; a tenant's keys must agree")
        by_digest[_digest(key)] = tenant
    return by_digest


def _parse(path: str, where: str) -> Any:
    with open(path, "rb") as f:
        data = f.read()
    if path.endswith(".toml"):
        try:
            import tomllib
        except ImportError:  # Python 3.10
            raise ValueError(f"{where}: a TOML keys file needs Python 3.11 (tomllib); give it as JSON") from None
        try:
            return tomllib.loads(data.decode("utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{where} is not valid TOML: {exc}") from None
    try:
        return json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{where} is not valid JSON (name a TOML file *.toml): {exc}") from None


def _entry(key: Any, entry: Any) -> Tenant:
    if not isinstance(key, str) or not key.strip() or key != key.strip():
        raise ValueError("the API key must be a non-empty string without surrounding spaces")
    if not isinstance(entry, dict):
        raise ValueError('the entry must be an object ({"tenant": NAME, "weight": W, "admin": B, "limits": {...}})')
    unknown = sorted(set(entry) - set(_ENTRY_FIELDS))
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(unknown)}; known: {', '.join(_ENTRY_FIELDS)}")
    name = entry.get("tenant")
    if not isinstance(name, str) or not 0 < len(name) <= MAX_TENANT_NAME:
        raise ValueError(f"tenant must be a non-empty string of at most {MAX_TENANT_NAME} characters")
    weight = entry.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not (weight > 0 and math.isfinite(weight)):
        raise ValueError(f"tenant {name!r}: weight must be a positive number, got {weight!r}")
    admin = entry.get("admin", False)
    if not isinstance(admin, bool):
        raise ValueError(f"tenant {name!r}: admin must be true or false, got {admin!r}")
    limits = entry.get("limits", {})
    if not isinstance(limits, dict):
        raise ValueError(f"tenant {name!r}: limits must be an object")
    known = [f.name for f in fields(TenantLimits)]
    unknown = sorted(set(limits) - set(known))
    if unknown:
        raise ValueError(f"tenant {name!r}: unknown limit(s) {', '.join(unknown)}; known: {', '.join(known)}")
    try:
        parsed = TenantLimits(**limits)
    except ValueError as exc:
        raise ValueError(f"tenant {name!r}: {exc}") from None
    return Tenant(name=name, weight=float(weight), admin=admin, limits=parsed)


def engine_session(session_id: str, tenant: str) -> str:
    """The engine's name for a tenant's session (scheduler/sessions.py has one namespace): the default tenant's
    ids as they are (a server without keys behaves as before), another's prefixed with its name, so a tenant
    can continue, pin and close only its own sessions. Too long for the engine's limit, the client's part is
    replaced by its digest."""
    if tenant == DEFAULT_TENANT:
        return session_id
    scoped = f"{tenant}/{session_id}"
    if len(scoped) <= MAX_SESSION_ID:
        return scoped
    return f"{tenant}/#{hashlib.sha256(session_id.encode('utf-8')).hexdigest()}"
