"""How a cluster is put together, in one place for the server and the cluster simulator.

`build_cluster` composes a cluster's global parts over instances of known cache sizes: the
prefill/decode roles (`engine.placement.roles`), the `Dispatcher`, and the `Migrator` that runs
the migration policy against the front end (any `MoveFront`: the server's engine client, or the
simulator), and hooks the server's metrics to them when given. The server reaches it through
`start_engines`, which starts Ray and the instances (one actor each), connects the engine client
to them and calls `build_cluster` once the instances have said how large their caches are; the
simulator calls it directly over its simulated instances.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tandem.cluster.config import ClusterConfig
from tandem.cluster.dispatch import Dispatcher
from tandem.cluster.migrator import Migrator, MoveFront
from tandem.config import EngineConfig
from tandem.engine import messages as m
from tandem.engine.core_client import AsyncEngineClient
from tandem.engine.placement import Disaggregation, roles
from tandem.kvtransfer.protocol import MoveReport

logger = logging.getLogger("tandem.cluster")


def cluster_roles(config: ClusterConfig) -> Disaggregation | None:
    """The instances' prefill/decode roles under `config` (None: every instance does both)."""
    return roles(config.prefill_instances, config.decode_instances, config.pd_min_prompt_tokens)


@dataclass
class Cluster:
    """A cluster's global parts."""

    config: ClusterConfig
    roles: Disaggregation | None
    dispatcher: Dispatcher
    migrator: Migrator


class ClusterMetrics(Protocol):
    """The server's metrics, as far as the cluster's parts feed them."""

    def track_cluster(
        self,
        num_instances: int,
        dispatched: Any,
        resumed: Any,
        migrating: Any,
        pd_fallbacks: Any,
        migrations_started: Any,
    ) -> None: ...


def build_cluster(
    config: ClusterConfig,
    front: MoveFront,
    num_blocks: Sequence[int],
    block_size: int,
    metrics: ClusterMetrics | None = None,
) -> Cluster:
    """Roles, dispatcher and migrator for instances with `num_blocks` KV blocks each; the migrator
    moves `front`'s requests (its rounds are started by the caller: `migrator.start()`, or the
    simulator's own clock). With `metrics`, the cluster's gauges read from `front` (an engine
    client) and the dispatcher."""
    dispatcher = Dispatcher(config, list(num_blocks), block_size)
    cluster = Cluster(config, cluster_roles(config), dispatcher, Migrator(config, front, dispatcher))
    if metrics is not None:
        if not isinstance(front, AsyncEngineClient):
            raise ValueError("the cluster's metrics read the server's engine client")
        client = front
        metrics.track_cluster(
            len(num_blocks),
            lambda i: dispatcher.num_dispatched[i],
            lambda: client.num_resumed,
            lambda: len(client.moves),
            lambda: client.num_pd_fallbacks,
            lambda: client.num_moves_started,
        )
    return cluster


@dataclass
class EngineHooks:
    """What the server wants told (metrics, its own state)."""

    on_stats: Callable[[int, m.Stats], None] | None = None
    on_dead: Callable[[str], None] | None = None
    on_migrated: Callable[[MoveReport], None] | None = None
    on_gone: Callable[[int], None] | None = None
    metrics: ClusterMetrics | None = None


class Engines:
    """The server's engine instances behind one client, and (several instances) their cluster."""

    def __init__(self, client: AsyncEngineClient, group: Any = None) -> None:
        self.client = client
        self.cluster: Cluster | None = None
        self._group = group  # the Ray placement group reserving the instances' CPUs

    @property
    def migrator(self) -> Migrator | None:
        return self.cluster.migrator if self.cluster is not None else None

    async def close(self) -> None:
        if self.cluster is not None:
            await self.cluster.migrator.stop()
        await self.client.shutdown()
        if self._group is not None:
            self._group.remove()


async def start_engines(
    engine_config: EngineConfig, config: ClusterConfig | None, hooks: EngineHooks
) -> Engines:
    """The server's engines, ready to serve: one spawned engine process without `config`; else
    Ray started (or joined), one actor per instance, the client connected to them and the cluster
    built (`build_cluster`), its migration rounds running if any trigger is on."""
    connections, group = None, None
    pd = cluster_roles(config) if config is not None else None
    if pd is not None:
        logger.info(
            "prefill/decode disaggregation: %d prefill, %d decode instance(s)",
            len(pd.prefill),
            len(pd.decode),
        )
    if config is not None:
        from tandem.cluster.ray_engine import InstanceGroup, start_ray

        await asyncio.get_running_loop().run_in_executor(None, start_ray, config)
        group = InstanceGroup(config)
        await group.ready(timeout=300)
        connections = group.connections(engine_config)
        logger.info(
            "%d engine instances on Ray, dispatch policy %s", config.num_instances, config.dispatch_policy
        )
    client = AsyncEngineClient(
        engine_config,
        on_stats=hooks.on_stats,
        on_dead=hooks.on_dead,
        connections=connections,
        on_migrated=hooks.on_migrated,
        disaggregation=pd,
        hang_timeout_s=config.instance_timeout_s if config is not None else None,
        on_gone=hooks.on_gone,
    )
    engines = Engines(client, group)
    if config is not None:

        def make_dispatcher(readies: list[m.Ready]) -> Dispatcher:
            blocks = [r.limits.num_blocks for r in readies]
            engines.cluster = build_cluster(
                config, client, blocks, readies[0].limits.block_size, hooks.metrics
            )
            return engines.cluster.dispatcher

        client.make_dispatcher = make_dispatcher
    try:
        await client.start()
    except BaseException:
        await engines.close()
        raise
    if engines.cluster is not None and config is not None and config.migration_triggers:
        engines.cluster.migrator.start()
    return engines
