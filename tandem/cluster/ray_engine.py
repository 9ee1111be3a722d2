"""Engine instances as Ray actors, and the front end's connection to each.

Ray places the instances (one actor process each, its CPUs reserved through a placement group
bundle), starts and stops them, and reports their death; the data path stays ZeroMQ: the front end
binds two `tcp://` sockets per instance on its node's address, and the actor runs
`core_proc.serve_engine` connected to them, exactly as the spawned engine process does over `ipc://`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from typing import Any

from tandem.cluster.config import ClusterConfig
from tandem.config import EngineConfig
from tandem.engine.connection import EngineConnection

logger = logging.getLogger("tandem.cluster")


def start_ray(config: ClusterConfig) -> None:
    """Join `config.ray_address`, or start a local Ray cluster (no dashboard) if none is running."""
    import ray

    if ray.is_initialized():
        return
    if config.ray_address is not None:
        ray.init(address=config.ray_address, log_to_driver=False)
    else:
        ray.init(include_dashboard=False, log_to_driver=False)


def _actor_class() -> Any:
    import ray

    # `serve` holds one thread for the instance's life; `stop` needs another. (Ray's typed overloads
    # of `remote` leave out the actor options, max_concurrency among them.)
    @ray.remote(max_concurrency=2)  # type: ignore[call-overload]
    class EngineInstance:
        """One engine instance: its own process, KV cache and threads."""

        def __init__(self) -> None:
            self._stop = threading.Event()

        def serve(self, config: EngineConfig, in_addr: str, out_addr: str) -> int:
            import logging as _logging

            from tandem.engine.core_proc import serve_engine

            _logging.basicConfig(level=_logging.INFO, format="%(asctime)s engine[%(process)d] %(message)s")
            return serve_engine(config, in_addr, out_addr, lambda: not self._stop.is_set())

        def stop(self) -> None:
            self._stop.set()

        def pid(self) -> int:
            return os.getpid()

    return EngineInstance


class InstanceGroup:
    """The placement group that reserves every instance's CPUs (one bundle per instance)."""

    def __init__(self, config: ClusterConfig) -> None:
        from ray.util.placement_group import placement_group

        self.config = config
        bundles = [{"CPU": config.cpus} for _ in range(config.num_instances)]
        self.pg = placement_group(bundles, strategy="SPREAD")
        self.actor_class = _actor_class()

    async def ready(self, timeout: float) -> None:
        import ray

        ready, _ = await asyncio.get_running_loop().run_in_executor(
            None, lambda: ray.wait([self.pg.ready()], timeout=timeout)
        )
        if not ready:
            raise RuntimeError(
                f"Ray could not reserve {self.config.num_instances} x {self.config.cpus} CPUs "
                f"within {timeout:.0f}s (see `ray status`)"
            )

    def connections(self, engine_config: EngineConfig) -> list[EngineConnection]:
        return [RayConnection(engine_config, self, i) for i in range(self.config.num_instances)]

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.pg)


class RayConnection(EngineConnection):
    """The front end's two sockets to the engine loop in one `EngineInstance` actor."""

    def __init__(self, engine_config: EngineConfig, group: InstanceGroup, index: int) -> None:
        super().__init__()
        self.engine_config = engine_config
        self.group = group
        self.index = index
        self.name = f"engine instance {index}"
        self.actor: Any = None
        self._ref: Any = None
        self._pid: int | None = None

    def launch(self) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        host = ray.util.get_node_ip_address()
        in_addr, out_addr = self.bind_tcp(host)
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=self.group.pg, placement_group_bundle_index=self.index
        )
        self.actor = self.group.actor_class.options(
            num_cpus=self.group.config.cpus,
            scheduling_strategy=strategy,
            name=None,
        ).remote()
        self._ref = self.actor.serve.remote(self.engine_config, in_addr, out_addr)

    async def handshake(self, extra_eos_token_ids: list[int], timeout: float) -> Any:
        ready = await super().handshake(extra_eos_token_ids, timeout)
        self._pid = ready.pid
        return ready

    @property
    def pid(self) -> int | None:
        return self._pid

    def exit_reason(self) -> str | None:
        import ray

        if self._ref is None:
            return None
        done, _ = ray.wait([self._ref], timeout=0)
        if not done:
            return None
        try:
            code = ray.get(self._ref)
        except Exception as exc:  # the actor died (killed, crashed, its node lost)
            return f"{self.name} died: {type(exc).__name__}"
        return f"{self.name} stopped (code {code})"

    async def stop_host(self, timeout: float) -> None:
        import ray

        if self.actor is None:
            return
        self.actor.stop.remote()
        await asyncio.get_running_loop().run_in_executor(None, lambda: ray.wait([self._ref], timeout=timeout))
        # Its loop has ended (or hangs): the actor's process goes too (a drained instance leaves nothing).
        ray.kill(self.actor)
