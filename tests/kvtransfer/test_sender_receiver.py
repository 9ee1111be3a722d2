"""The KV plane's two ends against fake hosts (fake_host.py): no model, no torch, every message
delivered when the test says. Each test walks rows of the transition table in
tandem/kvtransfer/protocol.py and checks what the two sides hold afterwards: a live migration
copies stage after stage while its request decodes on the source, pauses it only when little is
left, and the destination computes none of the request's context; refusals, failures, timeouts
and cancels leave the request running at its source and nothing held on either side."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
from fake_host import FakeHost, Network, reference

from tandem.core.engine_io import EngineCoreRequest
from tandem.engine import messages as m
from tandem.kvtransfer import protocol as p
from tandem.kvtransfer.plane import KVPlane
from tandem.kvtransfer.protocol import MoveOutcome, TransferState
from tandem.sampling_params import SamplingParams

PROMPT = list(range(1, 31))  # 30 tokens: 7 full blocks of 4 and a partial one
MAX_TOKENS = 64


class Pair:
    """A source (0) and a destination (1), each a fake host with its plane, on one network; a
    timeline of steps and messages in the order they happened."""

    def __init__(
        self,
        src: FakeHost | None = None,
        dst: FakeHost | None = None,
        *,
        max_stages: int = 4,
        stop_blocks: int = 1,
        timeout_s: float = 10.0,
    ) -> None:
        self.now = 0.0
        self.net = Network()
        self.hosts = [src or FakeHost(), dst or FakeHost()]
        self.reports: list[list[Any]] = [[], []]
        self.timeline: list[tuple[Any, ...]] = []
        self.planes = []
        dec = p.decoder()
        for i, host in enumerate(self.hosts):
            transport = self.net.transport(f"mem://{i}")
            send = transport.send

            def logged(peer: str, header: bytes, payload: Any = None, i: int = i, send: Any = send) -> None:
                send(peer, header, payload)
                self.timeline.append(("sent", i, dec.decode(header)))

            transport.send = logged  # type: ignore[method-assign]
            plane = KVPlane(
                host,
                transport,
                self.reports[i].append,
                timeout_s=timeout_s,
                max_stages=max_stages,
                stop_blocks=stop_blocks,
                clock=lambda: self.now,
            )
            self.planes.append(plane)

    @property
    def sender(self) -> Any:
        return self.planes[0].sender

    def move(self, rid: str, after_prefill: bool = False, prompt: list[int] = PROMPT) -> None:
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        req = EngineCoreRequest(rid, prompt, params, MAX_TOKENS, 0.0, incarnation=1)
        self.planes[0].sender.start(p.MigrateOut(req, f"{rid}@1", "mem://1", after_prefill))

    def step(self, i: int, times: int = 1) -> None:
        for _ in range(times):
            self.hosts[i].step()
            self.timeline.append(("step", i))
            self.planes[i].after_step()

    def deliver(self) -> None:
        """Every message in flight handled, and the answers they bring, until none is left."""
        while any(self.net.pending(f"mem://{i}") for i in range(2)):
            for plane in self.planes:
                plane.handle()

    def tick(self, seconds: float = 0.0) -> bool:
        self.now += seconds
        return any([plane.tick() for plane in self.planes])

    def sent(self, i: int, kind: type) -> list[Any]:
        return [e[2] for e in self.timeline if e[0] == "sent" and e[1] == i and isinstance(e[2], kind)]

    def steps_between(self, a: Any, b: Any) -> int:
        """Source steps between two messages of the timeline."""
        ids = [id(e[2]) if e[0] == "sent" else None for e in self.timeline]
        lo, hi = ids.index(id(a)), ids.index(id(b))
        return sum(1 for e in self.timeline[lo:hi] if e == ("step", 0))

    def outcome(self) -> p.Migrated:
        (report,) = self.reports[0]
        assert isinstance(report, p.Migrated)
        return report


def finish(pair: Pair, i: int, rid: str) -> list[int]:
    """Run `rid` to its end on host `i`; its whole output (what came before the move included)."""
    host = pair.hosts[i]
    tokens = list(host.tokens(rid))
    while rid in host.groups:
        tokens += host.step().get(rid, [])
    return tokens


def live_move(pair: Pair) -> None:
    """r runs on the source; a move of it is accepted and has not copied anything yet."""
    pair.hosts[0].add("r", PROMPT, MAX_TOKENS)
    pair.move("r")
    pair.deliver()
    assert pair.sender.transfers["r@1"].state is TransferState.COPYING
    assert pair.sent(0, p.Blocks) == []  # no stage before a step


def test_stages_go_while_the_request_decodes_and_the_pause_comes_when_little_is_left():
    pair = Pair(stop_blocks=1)
    src, dst = pair.hosts
    live_move(pair)
    pair.step(0)  # stage 1: the 7 full blocks, in one message that asks for Staged
    (stage1,) = pair.sent(0, p.Blocks)
    assert len(stage1.block_ids) == 7 and stage1.ack
    assert pair.sender.transfers["r@1"].state is TransferState.STAGING
    pair.step(0, 8)  # the request decodes 8 tokens (2 blocks) while stage 1 is on its way
    assert pair.sent(0, p.Blocks) == [stage1] and src.leader("r").status.name == "RUNNING"
    pair.deliver()  # Staged
    assert pair.sender.transfers["r@1"].state is TransferState.COPYING
    pair.step(0)  # 3 blocks filled since stage 1 > migration_stop_blocks: stage 2
    stage2 = pair.sent(0, p.Blocks)[1]
    assert len(stage2.block_ids) == 3 and stage2.ack
    pair.deliver()
    pair.step(0)  # nothing new filled: the pause, with the partly filled block only
    (handover,) = pair.sent(0, p.Handover)
    assert len(handover.block_ids) == 1
    assert pair.steps_between(stage1, stage2) == 9 and pair.steps_between(stage2, handover) == 1
    before = list(src.tokens("r"))
    pair.deliver()  # Installed: the request is ended at the source, the front end told
    report = pair.outcome()
    assert report.outcome is MoveOutcome.COMPLETED and report.num_stages == 2
    assert report.num_bytes == (7 + 3 + 1) * src.kv_block_bytes
    src.check_idle()
    # The destination computed nothing of the request's context: its KV arrived whole.
    assert dst.computed["r"] == 0
    moved = dst.leader("r")
    assert moved.num_computed_tokens == len(PROMPT) + len(before) - 1
    assert dst.history(moved) == moved.token_ids[:-1]
    tokens = finish(pair, 1, "r")
    assert tokens == reference(PROMPT, MAX_TOKENS)
    assert dst.computed["r"] == MAX_TOKENS - len(before)  # one token a step, each sampled there
    dst.check_idle()


def test_stages_stop_at_migration_max_stages():
    pair = Pair(stop_blocks=0, max_stages=2)
    live_move(pair)
    for _ in range(2):
        pair.step(0)
        pair.step(0, 8)  # 2 blocks filled while the stage is on its way
        pair.deliver()
    pair.step(0)
    assert [len(b.block_ids) for b in pair.sent(0, p.Blocks)] == [7, 3]
    # Two stages went: the rest (2 full blocks and the partial one) goes in the stop-and-copy.
    (handover,) = pair.sent(0, p.Handover)
    assert len(handover.block_ids) == 3
    pair.deliver()
    assert pair.outcome().outcome is MoveOutcome.COMPLETED and pair.outcome().num_stages == 2
    assert finish(pair, 1, "r") == reference(PROMPT, MAX_TOKENS) and pair.hosts[1].computed["r"] < MAX_TOKENS


def test_with_no_stage_allowed_a_move_is_a_stop_and_copy():
    pair = Pair(max_stages=0)
    live_move(pair)
    pair.step(0)
    assert pair.sent(0, p.Blocks) == []
    (handover,) = pair.sent(0, p.Handover)
    assert len(handover.block_ids) == 8
    pair.deliver()
    assert pair.outcome().num_stages == 0 and pair.outcome().outcome is MoveOutcome.COMPLETED
    assert finish(pair, 1, "r") == reference(PROMPT, MAX_TOKENS)


def test_a_stage_goes_one_message_per_step():
    pair = Pair(stop_blocks=2)
    pair.sender.per_message = 2  # two blocks a message
    live_move(pair)
    for n in range(1, 5):  # 7 blocks: 4 messages, one a step; only the last asks for Staged
        pair.step(0)
        assert [b.ack for b in pair.sent(0, p.Blocks)] == [False] * (n - 1) + [n == 4]
    pair.step(0, 3)
    assert len(pair.sent(0, p.Blocks)) == 4  # nothing more until Staged comes back
    pair.deliver()
    pair.step(0)  # 2 blocks filled since: not more than migration_stop_blocks, so the pause
    assert len(pair.sent(0, p.Handover)) == 1
    pair.deliver()
    assert pair.outcome().num_stages == 1
    assert finish(pair, 1, "r") == reference(PROMPT, MAX_TOKENS)


@pytest.mark.parametrize("short", ["seats", "blocks", "format", "limits"])
def test_a_refusal_leaves_the_request_where_it_was(short):
    dst = {
        "seats": FakeHost(max_seqs=0),
        "blocks": FakeHost(num_blocks=4),
        "format": FakeHost(kv_format_name="other"),
        "limits": FakeHost(max_model_len=50),
    }[short]
    pair = Pair(dst=dst)
    pair.hosts[0].add("r", PROMPT, MAX_TOKENS)
    pair.move("r")
    pair.deliver()
    report = pair.outcome()
    assert report.outcome is MoveOutcome.REFUSED and report.num_bytes == 0, report
    assert not pair.planes[0].active and not pair.planes[1].active
    assert finish(pair, 0, "r") == reference(PROMPT, MAX_TOKENS)
    for host in pair.hosts:
        host.check_idle()


def test_a_failed_stage_ends_the_move_and_the_request_goes_on():
    pair = Pair()
    live_move(pair)
    pair.hosts[1].fail_writes = True
    pair.step(0)
    pair.deliver()  # the stage cannot be written: Installed(failed)
    assert pair.outcome().outcome is MoveOutcome.ABORTED
    assert finish(pair, 0, "r") == reference(PROMPT, MAX_TOKENS)
    for host in pair.hosts:
        host.check_idle()


def test_a_destination_silent_after_the_handover_times_out():
    pair = Pair(timeout_s=2.0, max_stages=0)
    live_move(pair)
    pair.step(0)  # paused, Handover sent; the destination never reads it
    src = pair.hosts[0]
    assert src.leader("r").status.name == "PAUSED"
    pair.tick(1.9)
    assert pair.reports[0] == []
    pair.tick(0.2)
    report = pair.outcome()
    assert report.outcome is MoveOutcome.ABORTED and "no answer" in report.reason
    assert src.leader("r").status.name == "RUNNING"  # unpaused: it goes on here
    # The destination heard nothing after the Begin either: it dropped its reservation on its own.
    (dropped,) = pair.reports[1]
    assert isinstance(dropped, p.TransferDropped) and not pair.planes[1].active
    pair.deliver()  # the Handover and the Cancel, late: nothing is installed
    assert pair.hosts[1].samples("r") is None
    assert finish(pair, 0, "r") == reference(PROMPT, MAX_TOKENS)
    for host in pair.hosts:
        host.check_idle()


def test_a_stage_never_acknowledged_times_out():
    pair = Pair(timeout_s=2.0)
    live_move(pair)
    pair.step(0)  # stage 1 sent; Staged never comes
    pair.step(0, 3)
    pair.tick(2.1)
    assert pair.outcome().outcome is MoveOutcome.ABORTED
    assert pair.hosts[0].leader("r").status.name == "RUNNING"


@pytest.mark.parametrize("when", ["staging", "handing over"])
def test_the_request_ending_mid_move_cancels_it_at_both_ends(when):
    pair = Pair(max_stages=0 if when == "handing over" else 4)
    live_move(pair)
    pair.step(0)
    pair.hosts[0].abort_requests(["r"])  # the client went away
    pair.tick()
    assert pair.outcome().outcome is MoveOutcome.ABORTED and pair.outcome().reason == "the request ended"
    pair.deliver()  # the Cancel: the destination drops what it reserved (and any copy it made)
    for host in pair.hosts:
        host.check_idle()


def test_a_cancel_after_the_install_aborts_the_installed_run():
    pair = Pair(max_stages=0)
    live_move(pair)
    pair.step(0)
    pair.planes[1].handle()  # the destination installs it; the source has not heard yet
    assert pair.hosts[1].samples("r") is not None
    pair.sender.cancel("r@1")  # the front end gives up first (it took the destination for dead)
    assert pair.outcome().outcome is MoveOutcome.ABORTED
    pair.deliver()  # Installed (stale, ignored) and Cancel (the installed run is aborted)
    assert pair.hosts[1].samples("r") is None
    assert finish(pair, 0, "r") == reference(PROMPT, MAX_TOKENS)
    for host in pair.hosts:
        host.check_idle()


def test_a_request_not_running_is_left_to_recompute():
    pair = Pair()
    pair.hosts[0].add("r", PROMPT, MAX_TOKENS, waiting=True)
    pair.move("r")
    assert pair.outcome().outcome is MoveOutcome.RECOMPUTED
    assert pair.net.pending("mem://1") == 0


def test_a_handoff_streams_its_prefill_and_hands_over_at_the_first_token():
    """Prefill/decode: Begin at admission; the request waits (heartbeats keep the reservation),
    then each prefill chunk's blocks go after its step without waiting for an answer; at the first
    token it is handed over, and the decode side computes only what is sampled there."""
    pair = Pair(timeout_s=3.0, stop_blocks=100, max_stages=0)  # neither applies to a hand-off
    src, dst = pair.hosts
    src.add("r", PROMPT, MAX_TOKENS, chunk=8, waiting=True)
    pair.move("r", after_prefill=True)
    pair.deliver()
    for _ in range(4):  # it waits behind others for 4 s: a heartbeat a second or so
        pair.tick(1.0)
        pair.step(0)
        pair.deliver()
    assert pair.planes[1].active and not pair.reports[1]
    src.admit("r")
    for n in range(1, 4):  # 8 prompt tokens a step: two more full blocks each
        pair.step(0)
        assert [len(b.block_ids) for b in pair.sent(0, p.Blocks) if b.block_ids] == [2] * n
        assert not any(b.ack for b in pair.sent(0, p.Blocks))
    pair.step(0)  # the prompt's last 6 tokens and the first token: the hand-over
    (handover,) = pair.sent(0, p.Handover)
    assert len(handover.block_ids) == 2 and len(src.tokens("r")) == 1
    pair.deliver()
    report = pair.outcome()
    assert report.outcome is MoveOutcome.COMPLETED and report.num_stages == 3
    assert dst.computed["r"] == 0 and src.computed["r"] == len(PROMPT)
    assert finish(pair, 1, "r") == reference(PROMPT, MAX_TOKENS)
    assert dst.computed["r"] == MAX_TOKENS - 1
    for host in pair.hosts:
        host.check_idle()


def test_every_message_crosses_its_channel_unchanged():
    req = EngineCoreRequest("r", [1, 2], SamplingParams(max_tokens=3), 3, 0.0, incarnation=2)
    enc = p.encoder()
    state = p.SampleState([5], 2, [7], [], num_preemptions=1)
    for msg in (
        p.Begin("t", "mem://0", req, 1, 2, 64, "fake"),
        p.Accepted("t", False, "no"),
        p.Blocks("t", [1, 2], ack=True),
        p.Staged("t"),
        p.Handover("t", "mem://0", [3], [state, None]),
        p.Installed("t", True),
        p.Cancel("t"),
    ):
        assert p.decoder().decode(enc.encode(msg)) == msg
    for reply in (
        p.Migrated("r", "t", MoveOutcome.REFUSED, "no free sequence slot"),
        p.TransferDropped("r", "t", "silent"),
    ):
        assert m.client_decoder().decode(m.encoder().encode(reply)) == reply
    out = p.MigrateOut(req, "t", "mem://1", after_prefill=True)
    assert m.engine_decoder().decode(m.encoder().encode(out)) == out


def test_the_plane_imports_neither_the_engine_nor_torch():
    """kvtransfer sees the engine through KVHost only: no import cycle with tandem.engine."""
    code = (
        "import sys\nimport tandem.kvtransfer.plane, tandem.kvtransfer.sender, tandem.kvtransfer.receiver\n"
        "print('\\n'.join(sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    loaded = set(out.stdout.split())
    assert "torch" not in loaded
    assert not [name for name in loaded if name.startswith("tandem.engine")]
