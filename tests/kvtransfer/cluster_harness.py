"""Engine cores in one process, each with its real KV plane (ZeroMQ inboxes on ipc://), and a front
end reduced to what live migration needs of one: a route and an incarnation per request, a
destination's outputs held until the source's `Migrated`, stale runs dropped. Steps are driven by
hand, so tests place migrations at exact points (mid-prefill, first token, mid-decode)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from tandem.config import EngineConfig
from tandem.engine import messages as m
from tandem.engine.core import EngineCore
from tandem.engine.messages import EngineCoreRequest, SampleOutput
from tandem.kvtransfer.plane import KVPlane


class Node:
    def __init__(self, config: EngineConfig, bind: str) -> None:
        self.core = EngineCore(config)
        self.reports: list[m.Migrated | m.TransferDropped] = []
        self.plane = KVPlane(self.core, bind, self.reports.append)

    def step(self) -> list[SampleOutput]:
        outs = self.core.step() if self.core.has_unfinished_requests() else []
        self.plane.tick()
        return outs

    def pump(self) -> None:
        self.plane.handle()
        self.plane.tick()

    def pump_until(self, cond: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
        """Handle messages as they arrive (ZeroMQ delivers in the background) until `cond()`."""
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            self.plane.socket.poll(10)
            self.pump()

    def check_idle(self) -> None:
        """No request, reservation or block left but idle cached prefixes."""
        core = self.core
        assert not core.scheduler.requests and not core._groups, core._groups
        assert core.scheduler.reserved_seats == 0 and not core.scheduler.paused
        assert not self.plane.active
        assert core.kv.num_available == core.kv.num_blocks
        core.kv.check_invariants()


@dataclass
class Tracked:
    req: EngineCoreRequest
    node: int
    run: int
    tokens: dict[int, list[int]] = field(default_factory=dict)
    logprobs: dict[int, list] = field(default_factory=dict)
    # (first prompt token covered, its logprobs onwards) as the outputs brought them
    prompt_logprobs: list[tuple[int, list]] = field(default_factory=list)
    finished: set[int] = field(default_factory=set)
    pending: tuple[int, int, str] | None = None  # (destination, its run, transfer id)
    held: list[SampleOutput] = field(default_factory=list)
    next_run: int = 1


class Cluster:
    def __init__(self, config: EngineConfig, tmp: Path, num_nodes: int = 2) -> None:
        self.nodes = [Node(config, f"ipc://{tmp}/kv{i}") for i in range(num_nodes)]
        self.requests: dict[str, Tracked] = {}
        self.migrated = 0
        self.recomputed = 0
        self.stages: list[int] = []  # per completed migration
        self.dropped: list[m.TransferDropped] = []
        self.abandoned: list[str] = []

    def close(self) -> None:
        for n in self.nodes:
            n.plane.close()

    def add(self, req: EngineCoreRequest, node: int) -> None:
        self.nodes[node].core.add_request(req)
        self.requests[req.request_id] = Tracked(req, node, 0)

    def migrate(self, rid: str, dest: int, after_prefill: bool = False) -> bool:
        t = self.requests[rid]
        if t.pending is not None or t.node == dest or len(t.finished) == t.req.params.n:
            return False
        run = t.next_run
        t.next_run += 1
        tid = f"{rid}@{run}"
        t.pending = (dest, run, tid)
        peer = self.nodes[dest].plane.address
        msg = m.MigrateOut(replace(t.req, incarnation=run), tid, peer, after_prefill)
        self.nodes[t.node].plane.sender.start(msg)
        return True

    def wait_moved(self, rid: str, timeout: float = 10.0) -> None:
        """Pump transfer traffic, without stepping, until `rid`'s move in flight reports; a move
        placed at a tick must not depend on how fast the previous one's messages arrived."""
        deadline = time.monotonic() + timeout
        while self.requests[rid].pending is not None:
            assert time.monotonic() < deadline, f"{rid}'s move did not finish"
            for node in self.nodes:
                node.plane.socket.poll(5)
                node.pump()
                self._reports(node)

    def add_disaggregated(self, req: EngineCoreRequest, prefill: int, decode: int) -> None:
        """Prefill/decode: the request runs its prefill on `prefill` and is handed to `decode`."""
        self.add(req, prefill)
        assert self.migrate(req.request_id, decode, after_prefill=True)

    def _accept(self, so: SampleOutput) -> None:
        t = self.requests[so.request_id]
        toks = t.tokens.setdefault(so.index, [])
        assert so.index not in t.finished, f"{so.request_id}[{so.index}] got tokens after finishing"
        toks.extend(so.new_token_ids)
        if so.new_logprobs is not None:
            t.logprobs.setdefault(so.index, []).extend(so.new_logprobs)
        if so.prompt_logprobs:
            t.prompt_logprobs.append((so.prompt_logprobs_start, so.prompt_logprobs))
        if so.finish_reason is not None:
            t.finished.add(so.index)

    def _outputs(self, node: int, outs: list[SampleOutput]) -> None:
        for so in outs:
            t = self.requests.get(so.request_id)
            if t is None:
                continue
            if t.node == node and so.incarnation == t.run:
                self._accept(so)
            elif t.pending is not None and t.pending[0] == node and t.pending[1] == so.incarnation:
                t.held.append(so)

    def _reports(self, node: Node) -> None:
        reports = list(node.reports)
        node.reports.clear()
        for r in reports:
            if isinstance(r, m.TransferDropped):
                self.dropped.append(r)
                continue
            t = self.requests.get(r.request_id)
            if t is None or t.pending is None or t.pending[2] != r.transfer_id:
                continue
            dest, run, _ = t.pending
            t.pending = None
            held, t.held = t.held, []
            if r.ok:
                assert r.transfer_s >= r.downtime_s > 0, r
                t.node, t.run = dest, run
                self.migrated += 1
                self.stages.append(r.num_stages)
                for so in held:
                    self._accept(so)
            elif r.reason == "not_running":  # nothing computed worth moving: resume it there instead
                self.nodes[t.node].core.abort_requests([r.request_id])
                outs = [None if j in t.finished else list(t.tokens.get(j, [])) for j in range(t.req.params.n)]
                started = any(o is None or o for o in outs)
                self.nodes[dest].core.add_request(
                    replace(t.req, incarnation=run, resumed_outputs=outs if started else None)
                )
                t.node, t.run = dest, run
                self.recomputed += 1
            else:
                self.abandoned.append(r.reason)
                self.nodes[dest].core.abort_requests([r.request_id])

    def tick(self) -> None:
        """One step on every node, each followed by its transfer traffic."""
        for i, node in enumerate(self.nodes):
            self._outputs(i, node.step())
            self._reports(node)
            for other in self.nodes:
                other.pump()
                self._reports(other)

    def done(self) -> bool:
        return all(len(t.finished) == t.req.params.n for t in self.requests.values())

    def settle(self, max_ticks: int = 2000) -> None:
        for _ in range(max_ticks):
            if self.done() and not any(n.plane.active or n.core.has_unfinished_requests() for n in self.nodes):
                return
            self.tick()
        raise AssertionError("the cluster did not settle")
