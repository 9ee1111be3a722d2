"""Which waiting request goes next: scheduling policies, anti-starvation and tenant fair share.

Order of admission, from the top:
1. Tenant fair share. Among tenants with waiting requests, the one with the
   least weighted service (decayed count of tokens computed for it, divided by
   its weight) goes first, so a tenant's flood cannot take the engine, not even
   once its backlog has waited past the starvation timeout.
2. Starved requests first, within a tenant. A request that has waited
   `starvation_timeout_s` seconds outranks every request of its tenant that has
   not, whatever the policy; starved requests go oldest first. New arrivals
   cannot overtake a starved request, so every request is admitted within
   `starvation_timeout_s` plus the time the engine takes to admit the starved
   requests of its tenant that arrived before it (its tenant getting its fair
   share meanwhile): a hard, documented bound on queueing under any stream of
   favoured traffic.
3. The policy, within a tenant: `fcfs` (arrival order), `priority` (lower
   `priority` value first, then arrival) or `lpm` (longest cached prefix
   first, then arrival; falls back to fcfs beyond `lpm_max_queue` waiting
   requests, where matching every prompt each step would cost too much).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tandem.core.request import Request

# The scheduling policies by the names `scheduling_policy` and `--scheduling-policy` take; the engine
# config, the CLI and the scheduler all read them from here.
FCFS, PRIORITY, LPM = "fcfs", "priority", "lpm"
SCHEDULING_POLICIES = (FCFS, PRIORITY, LPM)


@dataclass(frozen=True, slots=True)
class TenantQuota:
    weight: float = 1.0
    max_running: int | None = None  # running sequences at once
    max_blocks: int | None = None  # KV blocks held at once

    def __post_init__(self) -> None:
        if not self.weight > 0:
            raise ValueError(f"tenant weight must be positive, got {self.weight}")
        for name in ("max_running", "max_blocks"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"tenant {name} must be at least 1, got {v}")


def parse_tenant_quotas(value: Any) -> dict[str, TenantQuota]:
    """`tenant_quotas` as given (tenant -> {"weight", "max_running", "max_blocks"}, or TenantQuotas
    already) as TenantQuotas; a ValueError names the field and the tenant."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"tenant_quotas must be a dict of tenant -> quota, got {type(value).__name__}")
    out = {}
    for name, quota in value.items():
        if isinstance(quota, TenantQuota):
            out[name] = quota
            continue
        if not isinstance(quota, dict):
            raise ValueError(f"tenant_quotas[{name!r}] must be a dict of weight/max_running/max_blocks")
        unknown = set(quota) - {"weight", "max_running", "max_blocks"}
        if unknown:
            raise ValueError(f"tenant_quotas[{name!r}] has unknown keys {sorted(unknown)}")
        try:
            out[name] = TenantQuota(**quota)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"tenant_quotas[{name!r}]: {exc}") from None
    return out


@dataclass(frozen=True, slots=True)
class SchedulingConfig:
    policy: str = FCFS
    starvation_timeout_s: float = 30.0
    lpm_max_queue: int = 128
    tenants: dict[str, TenantQuota] = field(default_factory=dict)
    default_quota: TenantQuota = TenantQuota()
    # Service counts decay by this factor each step so fair share follows recent load.
    service_decay: float = 0.99

    def __post_init__(self) -> None:
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.policy!r}")
        if not self.starvation_timeout_s > 0:
            raise ValueError(f"starvation_timeout_s must be positive, got {self.starvation_timeout_s}")

    def quota(self, tenant: str | None) -> TenantQuota:
        return self.tenants.get(tenant or "", self.default_quota)


class TenantLedger:
    """Per-tenant running counts, blocks held and decayed service, for limits and fair share."""

    def __init__(self, config: SchedulingConfig) -> None:
        self.config = config
        self.service: dict[str | None, float] = {}

    def charge(self, tenant: str | None, tokens: int) -> None:
        self.service[tenant] = self.service.get(tenant, 0.0) + tokens

    def decay(self) -> None:
        d = self.config.service_decay
        for t in self.service:
            self.service[t] *= d

    def share_key(self, tenant: str | None) -> float:
        return self.service.get(tenant, 0.0) / self.config.quota(tenant).weight


def admission_key(
    config: SchedulingConfig, ledger: TenantLedger, now: float, prefix_len: dict[str, int] | None
) -> Callable[[Request], tuple]:
    """Sort key of the admission order (see the module docstring): smaller goes first."""
    policy = config.policy
    timeout = config.starvation_timeout_s

    def key(r: Request) -> tuple:
        share = ledger.share_key(r.tenant)
        if now - r.arrival_time >= timeout:  # starved
            return (share, 0, (r.arrival_time,))
        if policy == PRIORITY:
            inner: tuple = (r.priority, r.arrival_time)
        elif policy == LPM and prefix_len is not None:
            inner = (-prefix_len.get(r.request_id, 0), r.arrival_time)
        else:
            inner = (0, r.arrival_time)
        return (share, 1, inner)

    return key


def order_waiting(
    waiting: list[Request],
    config: SchedulingConfig,
    ledger: TenantLedger,
    now: float,
    prefix_len: dict[str, int] | None,
) -> list[Request]:
    """Waiting requests in admission order (see the module docstring)."""
    return sorted(waiting, key=admission_key(config, ledger, now, prefix_len))
