"""The cluster layer's knobs (`tandem serve --num-instances ...`)."""

from __future__ import annotations

from dataclasses import dataclass

DISPATCH_POLICIES = ("round_robin", "least_load", "prefix_aware")


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    num_instances: int = 1
    # Ray cluster to join ("auto": the one `ray start` made on this host); None starts a local one.
    ray_address: str | None = None
    dispatch_policy: str = "least_load"
    # CPUs each instance's actor reserves (its torch threads; the engine config's num_threads).
    cpus_per_instance: float = 1.0
    # least_load: a request whose priority is below 0 (ahead of the default) counts its KV demand
    # this many times, so high-priority work lands where there is headroom.
    high_priority_weight: float = 2.0
    # prefix_aware: the cached prefix decides unless the instances are out of balance, as SGLang's
    # router judges it: the busiest holds more than `balance_abs_threshold` requests more than the
    # idlest and more than `balance_rel_threshold` times as many; then the idlest gets it (one hot
    # prefix must not pile its requests onto one instance).
    balance_abs_threshold: int = 4
    balance_rel_threshold: float = 1.5
    # prefix_aware: prompt blocks dispatched to an instance recently count as cached there (its
    # report may not show them yet); this many block hashes per instance are remembered.
    recent_prefix_blocks: int = 16384

    def __post_init__(self) -> None:
        if self.num_instances < 1:
            raise ValueError(f"--num-instances must be at least 1, got {self.num_instances}")
        if self.dispatch_policy not in DISPATCH_POLICIES:
            raise ValueError(
                f"--dispatch-policy must be one of {', '.join(DISPATCH_POLICIES)}, got {self.dispatch_policy!r}"
            )
        if not self.cpus_per_instance > 0:
            raise ValueError(f"cpus per instance must be positive, got {self.cpus_per_instance}")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1:
            raise ValueError("balance thresholds must be >= 0 (absolute) and >= 1 (relative)")
