"""The cluster layer's knobs (`tandem serve --num-instances ...`)."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.config import option

DISPATCH_POLICIES = ("round_robin", "least_load", "prefix_aware")
MIGRATION_TRIGGERS = ("imbalance", "priority")
MIGRATION_MODES = ("live", "recompute")


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    num_instances: int = option(
        1,
        "engine instances, each a Ray actor with its own KV cache (1: no Ray, one engine process)",
        group="cluster (Ray)",
    )
    # Ray cluster to join ("auto": the one `ray start` made on this host); None starts a local one.
    ray_address: str | None = option(
        None, "join this Ray cluster ('auto': the one on this host)", group="cluster (Ray)"
    )
    dispatch_policy: str = option(
        "least_load",
        "how new requests are spread over the instances",
        choices=DISPATCH_POLICIES,
        group="cluster (Ray)",
    )
    # CPUs each instance's actor reserves (its torch threads); None: `tandem serve` reserves the
    # engine's --num-threads (cluster_kwargs in tandem/entrypoints/cli.py), elsewhere 1 (`cpus`).
    cpus_per_instance: float | None = option(
        None, "CPUs Ray reserves for each instance (default: --num-threads, or 1)", group="cluster (Ray)"
    )
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
    # Moving running requests between instances (tandem/cluster/rebalance.py). Triggers: "imbalance"
    # (the busiest instance's load, as least_load counts it, exceeds the idlest's by more than
    # `imbalance_threshold`), "priority" (a high-priority request waits on an instance: a
    # lower-priority one there moves to where there is room). Draining an instance (scale in)
    # always migrates. Mode "live" copies the KV (tandem/kvtransfer); "recompute" resends the
    # request, which recomputes its KV where it lands.
    migration_triggers: tuple[str, ...] = option(
        (),
        "comma-separated: imbalance (move requests off the busiest instance), priority (make room "
        "for waiting high-priority requests); draining an instance (POST /admin/instances/N/drain) always migrates",
        group="cluster (Ray)",
        parse=lambda text: tuple(t.strip() for t in text.split(",") if t.strip()),
    )
    migration_mode: str = option(
        "live",
        "live: copy the KV cache between instances; recompute: resend the request",
        choices=MIGRATION_MODES,
        group="cluster (Ray)",
    )
    migration_interval_s: float = 0.05
    imbalance_threshold: float = option(
        0.2,
        "the imbalance trigger fires when the busiest instance's load (KV demand over KV size) "
        "exceeds the idlest's by more than this",
        group="cluster (Ray)",
    )
    max_concurrent_migrations: int = 4
    # An instance that says nothing for this long is taken for hung (it reports at least every
    # second; one engine step must fit well within it): its requests resume elsewhere, it is stopped.
    instance_timeout_s: float = option(
        60.0,
        "seconds without a word from an instance before it is taken for hung (its requests move on)",
        flag="--instance-timeout",
        group="cluster (Ray)",
    )
    # Prefill/decode disaggregation: instances 0..P-1 prefill, P..P+D-1 decode (num_instances = P+D).
    # Prompts shorter than `pd_min_prompt_tokens` skip it (prefilled where they decode): their
    # transfer would cost more than it saves (benchmarks/pd.py measures the crossover).
    prefill_instances: int = option(
        0,
        "prefill/decode disaggregation: this many instances prefill (with --decode-instances)",
        group="cluster (Ray)",
    )
    decode_instances: int = option(
        0, "instances that decode (with --prefill-instances)", group="cluster (Ray)"
    )
    pd_min_prompt_tokens: int = option(
        0,
        "shorter prompts skip disaggregation: prefilled on the decode instance itself",
        group="cluster (Ray)",
    )

    @property
    def cpus(self) -> float:
        """CPUs each instance's actor reserves."""
        return 1.0 if self.cpus_per_instance is None else self.cpus_per_instance

    @property
    def disaggregated(self) -> bool:
        return self.prefill_instances > 0

    def __post_init__(self) -> None:
        if self.num_instances < 1:
            raise ValueError(f"--num-instances must be at least 1, got {self.num_instances}")
        if self.dispatch_policy not in DISPATCH_POLICIES:
            raise ValueError(
                f"--dispatch-policy must be one of {', '.join(DISPATCH_POLICIES)}, got {self.dispatch_policy!r}"
            )
        if self.cpus_per_instance is not None and not self.cpus_per_instance > 0:
            raise ValueError(f"cpus per instance must be positive, got {self.cpus_per_instance}")
        unknown = set(self.migration_triggers) - set(MIGRATION_TRIGGERS)
        if unknown:
            raise ValueError(
                f"--migration-triggers takes {', '.join(MIGRATION_TRIGGERS)}; got {', '.join(sorted(unknown))}"
            )
        if self.migration_mode not in MIGRATION_MODES:
            raise ValueError(f"--migration-mode must be live or recompute, got {self.migration_mode!r}")
        if not self.migration_interval_s > 0 or self.max_concurrent_migrations < 1:
            raise ValueError("migration_interval_s must be positive and max_concurrent_migrations at least 1")
        if not self.imbalance_threshold >= 0:
            raise ValueError(f"--imbalance-threshold must be >= 0, got {self.imbalance_threshold}")
        if self.prefill_instances or self.decode_instances:
            if self.prefill_instances < 1 or self.decode_instances < 1:
                raise ValueError("--prefill-instances and --decode-instances must both be at least 1")
            if self.prefill_instances + self.decode_instances != self.num_instances:
                raise ValueError("num_instances must be prefill_instances + decode_instances")
        if not self.instance_timeout_s > 0:
            raise ValueError(f"--instance-timeout must be positive, got {self.instance_timeout_s}")
        if self.pd_min_prompt_tokens < 0:
            raise ValueError(f"--pd-min-prompt-tokens must be >= 0, got {self.pd_min_prompt_tokens}")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1:
            raise ValueError("balance thresholds must be >= 0 (absolute) and >= 1 (relative)")
