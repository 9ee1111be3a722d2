"""API keys, tenants and their limits.

`--api-key KEY` makes one tenant named "default"; `--api-keys-file FILE` maps keys to tenants:

    {"KEY": {"tenant": "NAME", "priority": 0, "max_concurrent": 8, "tokens_per_minute": 20000}}

Every field but `tenant` is optional. Each tenant gets its own prefix-cache salt (derived from a
secret made at start-up), so tenants never share cached prompt blocks. Limits: `max_concurrent`
sequences in flight (a request runs `n` of them, or `best_of`: each counts, as each takes a seat in
the batch); `tokens_per_minute` prompt plus generated tokens over a sliding minute (prompt tokens
are charged on admission, generated ones as they are produced, so a tenant's running requests hold
back its next admission at once, not only when they end). A request already admitted runs to its
end: the limits decide admission only.

Operator routes (draining an instance) take the operator's key (`--admin-api-key`), never a
tenant's: `check_admin_key`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from tandem.entrypoints.openai.errors import OpenAIError

WINDOW_S = 60.0
_FIELDS = {"tenant", "priority", "max_concurrent", "tokens_per_minute"}


@dataclass(slots=True)
class Tenant:
    name: str
    cache_salt: str
    priority: int | None = None
    max_concurrent: int | None = None
    tokens_per_minute: int | None = None
    inflight: int = 0
    window: deque[tuple[float, int]] = field(default_factory=deque)
    window_tokens: int = 0


def _positive_int(value: object, what: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return value


class Tenants:
    """Key -> tenant lookup and per-tenant admission. Without keys, authentication is off."""

    def __init__(self, entries: dict[str, dict] | None = None) -> None:
        self._secret = os.urandom(16)
        self.by_key: dict[str, Tenant] = {}
        by_name: dict[str, Tenant] = {}
        for key, spec in (entries or {}).items():
            where = f"api key entry {key[:4]}..."
            if not isinstance(key, str) or not key:
                raise ValueError("api keys must be non-empty strings")
            if not isinstance(spec, dict):
                raise ValueError(f"{where} must map to an object with a 'tenant' field")
            unknown = set(spec) - _FIELDS
            if unknown:
                raise ValueError(f"{where} has unknown fields {sorted(unknown)}; known: {sorted(_FIELDS)}")
            name = spec.get("tenant")
            if not isinstance(name, str) or not name:
                raise ValueError(f"{where} needs a non-empty string 'tenant'")
            priority = spec.get("priority")
            if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
                raise ValueError(f"{where}: priority must be an integer, got {priority!r}")
            tenant = by_name.get(name)
            if tenant is None:
                tenant = by_name[name] = Tenant(
                    name=name,
                    cache_salt=self._salt(name),
                    priority=priority,
                    max_concurrent=_positive_int(spec.get("max_concurrent"), f"{where}: max_concurrent"),
                    tokens_per_minute=_positive_int(
                        spec.get("tokens_per_minute"), f"{where}: tokens_per_minute"
                    ),
                )
            self.by_key[key] = tenant

    @classmethod
    def from_args(cls, api_key: str | None, api_keys_file: str | None) -> Tenants:
        entries: dict[str, dict] = {}
        if api_keys_file:
            try:
                data = json.loads(Path(api_keys_file).read_text())
            except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ValueError(f"cannot read --api-keys-file {api_keys_file!r}: {exc}") from exc
            if not isinstance(data, dict):
                raise ValueError(
                    f"--api-keys-file {api_keys_file!r} must hold a JSON object of key -> tenant"
                )
            entries.update(data)
        if api_key:
            entries[api_key] = {"tenant": "default"}
        return cls(entries)

    @property
    def enabled(self) -> bool:
        return bool(self.by_key)

    def _salt(self, name: str) -> str:
        return hmac.new(self._secret, name.encode(), hashlib.sha256).hexdigest()[:32]

    def authenticate(self, authorization: str | None) -> Tenant | None:
        """The caller's tenant (None when authentication is off); 401 for a missing or wrong key."""
        if not self.enabled:
            return None
        key = _bearer(authorization)
        if key is None:
            raise OpenAIError(
                401, "missing API key: send 'Authorization: Bearer KEY'", "authentication_error"
            )
        for known, tenant in self.by_key.items():
            if hmac.compare_digest(known.encode(), key.encode()):
                return tenant
        raise OpenAIError(401, "invalid API key", "authentication_error", code="invalid_api_key")

    def admit(self, tenant: Tenant, num_seqs: int, num_prompt_tokens: int) -> None:
        """Reserve `num_seqs` sequences (every sample of every prompt: n, or best_of) or raise 429
        with Retry-After; 400 for a request that could never fit the tenant's `max_concurrent`."""
        limit = tenant.max_concurrent
        if limit is not None and num_seqs > limit:
            raise OpenAIError(
                400,
                f"the request runs {num_seqs} sequences (prompts times n or best_of), more than tenant "
                f"{tenant.name!r} may run at once ({limit})",
                param="n",
            )
        if limit is not None and tenant.inflight + num_seqs > limit:
            raise OpenAIError(
                429,
                f"tenant {tenant.name!r} is at its limit of {limit} concurrent sequences",
                "rate_limit_error",
                code="rate_limit_exceeded",
                headers={"Retry-After": "1"},
            )
        if tenant.tokens_per_minute is not None:
            now = time.monotonic()
            self._expire(tenant, now)
            if tenant.window_tokens + num_prompt_tokens > tenant.tokens_per_minute:
                retry = WINDOW_S - (now - tenant.window[0][0]) if tenant.window else WINDOW_S
                raise OpenAIError(
                    429,
                    f"tenant {tenant.name!r} is over its limit of {tenant.tokens_per_minute} tokens per minute",
                    "rate_limit_error",
                    code="rate_limit_exceeded",
                    headers={"Retry-After": str(max(1, math.ceil(retry)))},
                )
        tenant.inflight += num_seqs
        self.charge(tenant, num_prompt_tokens)

    def release(self, tenant: Tenant, num_seqs: int, num_generated_tokens: int) -> None:
        """Give back what `admit` reserved; `num_generated_tokens`: those not charged yet."""
        tenant.inflight = max(0, tenant.inflight - num_seqs)
        self.charge(tenant, num_generated_tokens)

    def charge(self, tenant: Tenant, tokens: int) -> None:
        """Count `tokens` against the tenant's tokens per minute (generated ones as they come)."""
        if tenant.tokens_per_minute is None or tokens <= 0:
            return
        now = time.monotonic()
        self._expire(tenant, now)
        tenant.window.append((now, tokens))
        tenant.window_tokens += tokens

    @staticmethod
    def _expire(tenant: Tenant, now: float) -> None:
        while tenant.window and now - tenant.window[0][0] >= WINDOW_S:
            tenant.window_tokens -= tenant.window.popleft()[1]


def _bearer(authorization: str | None) -> str | None:
    """The key of an `Authorization: Bearer KEY` header, or None."""
    scheme, _, key = (authorization or "").partition(" ")
    key = key.strip()
    return key if scheme.lower() == "bearer" and key else None


def check_admin_key(authorization: str | None, admin_api_key: str | None) -> None:
    """Operator routes (draining an instance shuts it down) are off without `--admin-api-key`
    (404), whatever keys a caller sends; with it, they need exactly that key (401), a tenant's
    is not enough."""
    if admin_api_key is None:
        raise OpenAIError(
            404, "operator routes are disabled: start the server with --admin-api-key to enable them"
        )
    key = _bearer(authorization)
    if key is None or not hmac.compare_digest(key.encode(), admin_api_key.encode()):
        raise OpenAIError(
            401, "operator routes need the admin key: send 'Authorization: Bearer ADMIN_KEY'", "authentication_error"
        )
