"""Engine cores in one process, each with its real KV plane (ZeroMQ inboxes on ipc://), and a front
end reduced to what a move needs of one: the front end's own route table
(tandem/kvtransfer/routes.py: a route and a run per request, a destination's outputs held until
the source's `Migrated`, stale runs dropped).

Everything happens when the test says, whatever the machine's speed: `tick()` runs one step on
every engine (each followed by its plane's `after_step`, as the engine loop does), then delivers
every KV message in flight and every answer it brings (`deliver()` waits for ZeroMQ to hand over
exactly the messages sent, counted at both ends), then runs the planes' timeouts. The planes'
clock is the harness's (`advance`), so a timeout fires when a test moves time past it and never
because a machine was slow. A test can hold a node's inbox (`holding`) to let steps run while a
message waits, which is how it places the steps between a move's stages.

Each node records what its engine computed per sample (`computed`: the computed-token count before
and the tokens scheduled, per step) and what its plane sent (`sent`: each message with the source's
output count of its request when it went), so tests can check that stages go out while the request
decodes. Every completed move is checked when the cluster settles (`check_moves`): the destination
took the sample over with all its KV (every token but the last sampled one computed, for a sample
that had sampled one) and from there computed each token once, from where the source had got to:
a silent fallback to recomputing the context would fail it.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tandem.config import EngineConfig
from tandem.core.engine_io import EngineCoreRequest, SampleOutput
from tandem.engine.core import EngineCore
from tandem.kvtransfer import protocol as p
from tandem.kvtransfer.plane import KVPlane
from tandem.kvtransfer.protocol import MoveOutcome
from tandem.kvtransfer.routes import LiveMove, Routes, migrate_out

# Waiting for ZeroMQ to deliver what was sent: only a lost message (a bug) takes this long.
DELIVERY_TIMEOUT_S = 60.0


@dataclass
class Sent:
    """A KV message a node sent, and how many tokens its request had produced there then."""

    msg: Any
    source_tokens: int


class Node:
    def __init__(self, config: EngineConfig, bind: str, clock: Any) -> None:
        self.core = EngineCore(config)
        self.reports: list[p.Migrated | p.TransferDropped] = []
        self.plane = KVPlane.open(self.core, config, bind, self.reports.append, clock=clock)
        self.received = 0
        self.sent_to: Counter[str] = Counter()
        self.sent: list[Sent] = []
        # sample id -> (num_computed_tokens before, tokens scheduled) per step that scheduled it
        self.computed: dict[str, list[tuple[int, int]]] = {}
        self._wrap()

    def _wrap(self) -> None:
        transport, scheduler = self.plane.transport, self.core.scheduler
        send, recv, schedule = transport.send, transport.recv, scheduler.schedule
        dec = p.decoder()

        def counted_send(peer: str, header: bytes, payload: Any = None) -> None:
            send(peer, header, payload)
            self.sent_to[peer] += 1
            msg = dec.decode(header)
            rid = msg.transfer_id.rsplit("@", 1)[0]
            group = self.core.samples(rid) or []
            self.sent.append(Sent(msg, max((r.num_output_tokens for r in group if r is not None), default=0)))

        def counted_recv() -> Any:
            msg = recv()
            self.received += msg is not None
            return msg

        def recorded_schedule() -> Any:
            out = schedule()
            for r, n in zip(out.requests, out.num_tokens):
                self.computed.setdefault(r.request_id, []).append((r.num_computed_tokens, n))
            return out

        transport.send = counted_send  # type: ignore[method-assign]
        transport.recv = counted_recv  # type: ignore[method-assign]
        scheduler.schedule = recorded_schedule  # type: ignore[method-assign]

    def step(self) -> list[SampleOutput]:
        """One engine step (if there is work), then the plane's after-step, as the engine loop."""
        if not self.core.has_unfinished_requests():
            return []
        outs = self.core.step()
        self.plane.after_step()
        return outs

    def messages(self, kind: type) -> list[Sent]:
        return [s for s in self.sent if isinstance(s.msg, kind)]

    def check_idle(self) -> None:
        """No request, reservation or block left but idle cached prefixes."""
        core = self.core
        assert not core.scheduler.requests and not core._groups, core._groups
        assert core.scheduler.reserved_seats == 0 and not core.scheduler.paused
        assert not self.plane.active
        assert core.kv.num_available == core.kv.num_blocks
        core.kv.check_invariants()


@dataclass
class Visit:
    """A sample's stay on a node it was moved to with its KV (until it leaves again)."""

    sample: str
    node: int
    start: int  # its first entry there in the node's `computed`
    context: int  # its computed tokens when installed
    decoding: bool  # it had sampled a token (only its last sampled token lacked KV)
    end: int | None = None


@dataclass
class Tracked:
    req: EngineCoreRequest
    routes: Routes
    tokens: dict[int, list[int]] = field(default_factory=dict)
    logprobs: dict[int, list] = field(default_factory=dict)
    # (first prompt token covered, its logprobs onwards) as the outputs brought them
    prompt_logprobs: list[tuple[int, list]] = field(default_factory=list)
    finished: set[int] = field(default_factory=set)

    @property
    def node(self) -> int:
        """The node that runs it now."""
        return self.routes.where[self.req.request_id]

    @property
    def pending(self) -> LiveMove | None:
        """Its move under way."""
        return self.routes.moves.get(self.req.request_id)


class Cluster:
    def __init__(self, config: EngineConfig, tmp: Path, num_nodes: int = 2) -> None:
        self.now = 0.0
        # Speculative steps compute drafts and roll back: the computed counts are not one a step.
        self.exact_compute = config.speculative_config is None
        self.visits: list[Visit] = []
        self.nodes = [Node(config, f"ipc://{tmp}/kv{i}", self.clock) for i in range(num_nodes)]
        self.requests: dict[str, Tracked] = {}
        self.routes = Routes()
        self.held: set[int] = set()  # nodes whose inbox is left unread
        self.migrated = 0
        self.recomputed = 0
        self.stages: list[int] = []  # per completed migration
        self.dropped: list[p.TransferDropped] = []
        self.abandoned: list[str] = []
        self.outcomes: list[MoveOutcome] = []
        self.reports: list[p.Migrated] = []  # every Migrated the front end heard, in order

    def clock(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move the planes' clock on (timeouts)."""
        self.now += seconds

    def close(self) -> None:
        for n in self.nodes:
            n.plane.close()

    def replace_node(self, i: int, config: EngineConfig, bind: str) -> None:
        self.nodes[i].plane.close()
        self.nodes[i] = Node(config, bind, self.clock)

    def add(self, req: EngineCoreRequest, node: int) -> None:
        run = self.routes.next_run(req.request_id)
        self.nodes[node].core.add_request(replace(req, incarnation=run))
        self.routes.route(req.request_id, node)
        self.requests[req.request_id] = Tracked(req, self.routes)

    def migrate(self, rid: str, dest: int, after_prefill: bool = False) -> bool:
        """Start a move (its Begin goes out now); False if one is under way or it cannot move."""
        t = self.requests[rid]
        if t.pending is not None or t.node == dest or len(t.finished) == t.req.params.n:
            return False
        source = t.node
        move = self.routes.start_move(rid, source, dest, self.now, after_prefill)
        self.nodes[source].plane.sender.start(migrate_out(t.req, move, self.nodes[dest].plane.address))
        self._reports(source)
        return True

    def add_disaggregated(self, req: EngineCoreRequest, prefill: int, decode: int) -> None:
        """Prefill/decode: the request runs its prefill on `prefill` and is handed to `decode`."""
        self.add(req, prefill)
        assert self.migrate(req.request_id, decode, after_prefill=True)

    @contextmanager
    def holding(self, *nodes: int) -> Iterator[None]:
        """Leave these nodes' inboxes unread meanwhile (what is sent to them waits)."""
        self.held |= set(nodes)
        try:
            yield
        finally:
            self.held -= set(nodes)

    def deliver(self) -> None:
        """Every KV message sent to a node not held is handled there, with the answers it brings,
        until none is left in flight; then the outcomes reach the front end."""
        deadline = time.monotonic() + DELIVERY_TIMEOUT_S
        while True:
            behind = [
                n
                for i, n in enumerate(self.nodes)
                if i not in self.held and sum(o.sent_to[n.plane.address] for o in self.nodes) > n.received
            ]
            if not behind:
                break
            assert time.monotonic() < deadline, "a KV message was lost"
            for n in behind:
                n.plane.socket.poll(5)
                n.plane.handle()
        for i in range(len(self.nodes)):
            self._reports(i)

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
            if so.request_id in self.requests and self.routes.sort(node, so):
                self._accept(so)

    def _reports(self, index: int) -> None:
        node = self.nodes[index]
        reports = list(node.reports)
        node.reports.clear()
        for r in reports:
            if isinstance(r, p.TransferDropped):
                self.dropped.append(r)
                continue
            self.reports.append(r)
            t = self.requests.get(r.request_id)
            move = self.routes.outcome(index, r) if t is not None else None
            if t is None or move is None:
                continue
            dest = move.destination
            self.outcomes.append(r.outcome)
            self._left(r.request_id, move.source)
            if r.outcome is MoveOutcome.COMPLETED:
                assert r.transfer_s >= r.pause_s >= 0, r
                self._arrived(r.request_id, dest)
                self.migrated += 1
                self.stages.append(r.num_stages)
                for so in self.routes.complete(r.request_id, move):
                    self._accept(so)
            elif r.outcome is MoveOutcome.RECOMPUTED:  # nothing computed worth moving: resume it there
                self.nodes[move.source].core.abort_requests([r.request_id])
                outs = [None if j in t.finished else list(t.tokens.get(j, [])) for j in range(t.req.params.n)]
                started = any(o is None or o for o in outs)
                run = self.routes.route(r.request_id, dest)
                self.nodes[dest].core.add_request(
                    replace(t.req, incarnation=run, resumed_outputs=outs if started else None)
                )
                self.recomputed += 1
            else:
                self.abandoned.append(r.reason)
                self.nodes[dest].core.abort_requests([r.request_id])

    def _arrived(self, rid: str, node: int) -> None:
        computed = self.nodes[node].computed
        samples = [r for r in self.nodes[node].core.samples(rid) or [] if r is not None]
        forks = {id(c) for r in samples for c in r.pending_children}  # still to fork off a leader
        for r in samples:
            if id(r) in forks:
                continue
            assert r.num_computed_tokens > 0, r.request_id  # a request with no KV is not moved live
            decoding = r.num_output_tokens > 0
            if decoding:  # all its KV came: only its last sampled token is left to compute
                assert r.num_computed_tokens == r.num_tokens - 1, (r.request_id, r.num_computed_tokens)
            start = len(computed.get(r.request_id, []))
            self.visits.append(Visit(r.request_id, node, start, r.num_computed_tokens, decoding))

    def _left(self, rid: str, node: int) -> None:
        computed = self.nodes[node].computed
        for v in self.visits:
            if v.node == node and v.end is None and v.sample.split("#")[0] == rid:
                v.end = len(computed.get(v.sample, []))

    def check_moves(self) -> None:
        """Each sample moved with its KV computed nothing twice where it went: its first step there
        started from its installed context (all but its last sampled token, once it had one), and
        each later step from where the one before ended."""
        for v in self.visits:
            steps = self.nodes[v.node].computed.get(v.sample, [])[v.start : v.end]
            assert steps or v.end is not None, v  # it ran there
            if v.decoding:
                assert all(n == 1 for _, n in steps), (v, steps[:4])  # no prefill there
            expect = v.context
            for before, n in steps:
                assert before == expect, (v, steps[:4])
                expect += n

    def tick(self) -> None:
        """One step on every node, then every message in flight delivered and the timeouts run."""
        for i, node in enumerate(self.nodes):
            self._outputs(i, node.step())
        self.deliver()
        for node in self.nodes:
            node.plane.tick()
        self.deliver()

    def done(self) -> bool:
        return all(len(t.finished) == t.req.params.n for t in self.requests.values())

    def settle(self, max_ticks: int = 2000) -> None:
        for _ in range(max_ticks):
            if self.done() and not any(
                n.plane.active or n.core.has_unfinished_requests() for n in self.nodes
            ):
                if self.exact_compute:
                    self.check_moves()
                return
            self.tick()
        raise AssertionError("the cluster did not settle")
