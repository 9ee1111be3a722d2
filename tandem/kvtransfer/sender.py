"""The source end of a move: copy a request's KV in stages while it decodes, pause it, hand it over.

The states, the messages and the transition table are in protocol.py. In short: a live migration
sends, after a step, the full blocks computed since its last stage (full computed blocks never
change, so what was sent stays valid), one message per step; the destination answers the stage's
last message with Staged, and only then, after another step, does the sender look again: another
stage if more than `migration_stop_blocks` blocks were filled meanwhile (and fewer than
`migration_max_stages` went), else it pauses the request and sends the rest (the partly filled
block too) with the request's state in the Handover. The destination installs it and says so;
only then is it ended here and the front end told (`Migrated`), so exactly one engine owns the
request at any time. If the destination refuses, fails, dies (the front end sends MigrateCancel)
or stays silent past the timeout, the request is unpaused and goes on here; the destination frees
what it reserved on Cancel (or on its own timeout).

Every block a stage took holds a reference of the sender's until the transfer ends, so its id
cannot be reused for other tokens while the destination still maps it.

The loop's own share of a stage is one gather a step (`read_blocks` of at most MAX_PAYLOAD_BYTES);
the transport queues the message (`zmq`: without a copy) and ZeroMQ's I/O thread writes it while
the next steps run. A sending thread of our own would add a second writer to sockets that are not
thread-safe and a competitor for the cores the step's kernels use, and save only that gather.

A prefill/decode hand-off (`after_prefill`) is the same transfer started with the request's Add:
the destination reserves the prompt's blocks at once, each step's newly computed full blocks go
as a stage without waiting for an answer (the copy overlaps the prefill, chunk by chunk), and the
hand-over comes as soon as the first token is sampled. While the request waits or computes
without filling a block, empty stages every third of the timeout tell the destination the source
lives.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from tandem.core.request import Request, RequestStatus
from tandem.kvtransfer.host import KVHost
from tandem.kvtransfer.protocol import (
    Accepted,
    Begin,
    Blocks,
    Cancel,
    Handover,
    Installed,
    Migrated,
    MigrateOut,
    MoveLog,
    MoveOutcome,
    SampleState,
    Staged,
    TransferState,
)
from tandem.kvtransfer.transport import MAX_PAYLOAD_BYTES

logger = logging.getLogger("tandem.kvtransfer")

Send = Callable[[str, Any, Any], None]


@dataclass(slots=True)
class Outgoing:
    transfer_id: str
    request_id: str
    peer: str
    handoff: bool  # prefill/decode: hand over at the first token
    state: TransferState
    started: float
    # When the answer awaited now (Accepted, Staged, Installed) is overdue; inf while none is.
    deadline: float = math.inf
    held: dict[int, None] = field(default_factory=dict)  # blocks taken into a stage (one ref each)
    queued: list[int] = field(default_factory=list)  # of those, the ones not sent yet
    paused: list[Request] = field(default_factory=list)
    paused_at: float = 0.0
    num_stages: int = 0
    num_bytes: int = 0
    last_sent: float = 0.0


class Sender:
    def __init__(
        self,
        host: KVHost,
        address: str,
        send: Send,
        report: Callable[[Migrated], None],
        *,
        timeout_s: float,
        max_stages: int,
        stop_blocks: int,
        clock: Callable[[], float] = time.monotonic,
        log: MoveLog | None = None,
    ) -> None:
        self.host = host
        self.log = log
        self.address = address
        self.send = send
        self.report = report
        self.clock = clock
        self.timeout = timeout_s
        self.max_stages = max_stages
        self.stop_blocks = stop_blocks
        self.transfers: dict[str, Outgoing] = {}
        # Blocks per message: a step gathers at most this many for a stage.
        self.per_message = max(1, MAX_PAYLOAD_BYTES // host.kv_block_bytes)

    @property
    def active(self) -> bool:
        return bool(self.transfers)

    def start(self, msg: MigrateOut) -> None:
        req = msg.request
        rid = req.request_id
        now = self.clock()
        if msg.transfer_id in self.transfers or any(t.request_id == rid for t in self.transfers.values()):
            self._refuse(msg, MoveOutcome.ABORTED, "already moving")
            return
        bs = self.host.block_size
        if msg.after_prefill:
            if self.host.samples(rid) is None:
                self._refuse(msg, MoveOutcome.ABORTED, "not on this engine")
                return
            # The prompt's blocks, and one more per sample for its first tokens after the fork.
            num_seats = req.params.n
            num_blocks = -(-len(req.prompt_token_ids) // bs) + req.params.n
            # A hand-off streams its stages without waiting for Accepted: the destination reads them
            # after the Begin (one ordered channel) and drops them if it refused.
            state = TransferState.COPYING
        else:
            leaders = self._leaders(rid)
            if leaders is None:
                self._refuse(msg, MoveOutcome.RECOMPUTED, "not running here")
                return
            num_seats = sum(r.num_seats for r in leaders)
            num_blocks = len(self._computed(leaders, partial=True)) + len(leaders)
            state = TransferState.ACCEPTING
        out = Outgoing(msg.transfer_id, rid, msg.peer, msg.after_prefill, state, now, last_sent=now)
        if state is TransferState.ACCEPTING:
            out.deadline = now + self.timeout
        self.transfers[msg.transfer_id] = out
        begin = Begin(
            transfer_id=msg.transfer_id,
            reply_to=self.address,
            request=req,
            num_seats=num_seats,
            num_blocks=num_blocks,
            block_bytes=self.host.kv_block_bytes,
            kv_cache_dtype=self.host.kv_format_name,
        )
        if self._send(out, begin):
            self._note("begin", rid, blocks=num_blocks)

    def _note(self, kind: str, request_id: str, **fields: Any) -> None:
        if self.log is not None:
            self.log(kind, request_id, self.clock(), **fields)

    def _refuse(self, msg: MigrateOut, outcome: MoveOutcome, reason: str) -> None:
        self.report(Migrated(msg.request.request_id, msg.transfer_id, outcome, reason))

    def _leaders(self, rid: str) -> list[Request] | None:
        """The request's running samples that hold blocks (forks pending on them ride along), or
        None if it is not wholly running here (waiting, preempted, paused or gone)."""
        samples = self.host.samples(rid)
        if samples is None:
            return None
        live = [r for r in samples if r is not None]
        leaders = [r for r in live if r.status in (RequestStatus.RUNNING, RequestStatus.PAUSED)]
        pending = {id(c) for r in leaders for c in r.pending_children}
        if not leaders or any(id(r) not in pending and r not in leaders for r in live):
            return None
        return leaders

    def _computed(self, leaders: Iterable[Request], partial: bool) -> list[int]:
        """The leaders' blocks holding computed tokens, each once: the full ones, or with `partial`
        the partly filled last ones too."""
        bs = self.host.block_size
        out: dict[int, None] = {}
        for r in leaders:
            n = -(-r.num_computed_tokens // bs) if partial else r.num_computed_tokens // bs
            out.update(dict.fromkeys(r.block_ids[:n]))
        return list(out)

    def _send(self, out: Outgoing, msg: Any, payload: Any = None) -> bool:
        try:
            self.send(out.peer, msg, payload)
        except Exception as exc:  # a peer we cannot reach ends this transfer only
            self._abort(out, f"send failed: {exc}")
            return False
        out.last_sent = self.clock()
        return True

    # -- replies from the destination ---------------------------------------------------------

    def _answered(self, msg: Accepted | Installed, state: TransferState) -> Outgoing | None:
        """The transfer a destination's answer is about, if the answer is yes and the transfer is in
        `state`; a no ends the transfer (the request stays here)."""
        out = self.transfers.get(msg.transfer_id)
        if out is None:
            return None
        if not msg.ok:
            # A no to Begin is a refusal (nothing was copied); any other no, a failure.
            outcome = MoveOutcome.REFUSED if isinstance(msg, Accepted) else MoveOutcome.ABORTED
            self._abort(out, msg.reason, cancel=False, outcome=outcome)
            return None
        return out if out.state is state else None

    def on_accepted(self, msg: Accepted) -> None:
        out = self._answered(msg, TransferState.ACCEPTING)
        if out is not None:
            # The first stage goes after the next step (`after_step`), not from here.
            out.state = TransferState.COPYING
            out.deadline = math.inf

    def on_staged(self, msg: Staged) -> None:
        out = self.transfers.get(msg.transfer_id)
        if out is not None and out.state is TransferState.STAGING and not out.queued:
            out.state = TransferState.COPYING
            out.deadline = math.inf

    def on_installed(self, msg: Installed) -> None:
        out = self._answered(msg, TransferState.HANDING_OVER)
        if out is None:
            return
        del self.transfers[out.transfer_id]
        self._release(out)
        # The destination runs it now: end it here without a word to the front end (but this).
        self.host.abort_requests([out.request_id])
        now = self.clock()
        self._note(
            "end", out.request_id, outcome=MoveOutcome.COMPLETED.value, stages=out.num_stages,
            transfer_s=round(now - out.started, 7), pause_s=round(now - out.paused_at, 7),
        )
        logger.debug(
            "%s moved: %d stage(s) while it ran, %d bytes, paused %.1f ms",
            out.request_id, out.num_stages, out.num_bytes, (now - out.paused_at) * 1e3,
        )
        self.report(
            Migrated(
                out.request_id,
                out.transfer_id,
                MoveOutcome.COMPLETED,
                num_bytes=out.num_bytes,
                num_stages=out.num_stages,
                transfer_s=now - out.started,
                pause_s=now - out.paused_at,
            )
        )

    def cancel(self, transfer_id: str) -> None:
        """The front end gives the transfer up (its destination died): the request stays here."""
        out = self.transfers.get(transfer_id)
        if out is not None:
            self._abort(out, "the destination is gone")

    # -- the engine loop's calls --------------------------------------------------------------

    def after_step(self) -> None:
        """After an engine step: each transfer copying sends its next message, or its next stage,
        or pauses its request and hands it over."""
        for out in list(self.transfers.values()):
            if out.state in (TransferState.COPYING, TransferState.STAGING):
                self._advance(out)

    def tick(self) -> None:
        """On every pass of the loop: give up transfers whose request ended or whose destination
        is overdue with its answer."""
        now = self.clock()
        for out in list(self.transfers.values()):
            if self.host.samples(out.request_id) is None:  # aborted meanwhile (the client left)
                self._abort(out, "the request ended")
            elif now > out.deadline:
                self._abort(out, f"no answer from the destination in {self.timeout:g}s")

    # -- copying --------------------------------------------------------------------------------

    def _advance(self, out: Outgoing) -> None:
        leaders = self._leaders(out.request_id)
        if leaders is None:
            if out.handoff and self.host.samples(out.request_id) is not None:
                self._heartbeat(out)  # waiting (or preempted): its prefill has not run yet
                return
            self._abort(out, "the request ended or was preempted")
            return
        if out.handoff:
            self._stream(out, leaders)
        elif out.state is TransferState.STAGING:
            if out.queued:
                self._send_next(out)
        else:
            new = [b for b in self._computed(leaders, partial=False) if b not in out.held]
            if len(new) > self.stop_blocks and out.num_stages < self.max_stages:
                self._take(out, new)
                out.state = TransferState.STAGING
                self._send_next(out)
            else:
                self._hand_over(out, leaders)

    def _stream(self, out: Outgoing, leaders: list[Request]) -> None:
        """A hand-off's step: the blocks its prefill filled join the queue; at its first token it
        is handed over, else the queue's next message (or a heartbeat) goes."""
        if all(r.num_output_tokens >= 1 and not r.pending_children for r in leaders):
            self._hand_over(out, leaders)
            return
        new = [b for b in self._computed(leaders, partial=False) if b not in out.held]
        if new:
            self._take(out, new)
        if out.queued:
            self._send_next(out)
        else:
            self._heartbeat(out)

    def _take(self, out: Outgoing, blocks: list[int]) -> None:
        """A new stage: `blocks` are held (not reused while the destination maps them) and queued."""
        self.host.hold_blocks(blocks)
        out.held.update(dict.fromkeys(blocks))
        out.queued += blocks
        out.num_stages += 1
        self._note("stage", out.request_id, blocks=len(blocks))

    def _send_next(self, out: Outgoing) -> None:
        """The queue's next message; a live migration's last one of a stage asks for Staged."""
        chunk, out.queued = out.queued[: self.per_message], out.queued[self.per_message :]
        ack = not out.queued and not out.handoff
        if self._send_blocks(out, Blocks(out.transfer_id, chunk, ack), chunk) and ack:
            out.deadline = self.clock() + self.timeout

    def _heartbeat(self, out: Outgoing) -> None:
        if self.clock() - out.last_sent > self.timeout / 3:
            self._send(out, Blocks(out.transfer_id, []))

    def _chunks(self, blocks: list[int]) -> list[list[int]]:
        """`blocks` split into messages of at most MAX_PAYLOAD_BYTES (at least one, maybe empty)."""
        per = self.per_message
        return [blocks[i : i + per] for i in range(0, len(blocks), per)] or [[]]

    def _send_blocks(self, out: Outgoing, msg: Blocks | Handover, blocks: list[int]) -> bool:
        data = self.host.read_blocks(blocks) if blocks else None
        if data is not None:
            out.num_bytes += memoryview(data).nbytes
        return self._send(out, msg, data)

    def _hand_over(self, out: Outgoing, leaders: list[Request]) -> None:
        """Pause the request and send what the destination lacks: the stage's unsent messages, the
        blocks computed since (the partly filled ones too), and the samples' state."""
        for r in leaders:
            self.host.pause(r)
        out.paused = leaders
        out.paused_at = self.clock()
        rest = out.queued + [b for b in self._computed(leaders, partial=True) if b not in out.held]
        out.queued = []
        self._note("pause", out.request_id, blocks=len(rest))
        samples = self.host.samples(out.request_id) or []
        states: list[SampleState | None] = [None] * len(samples)
        for r in leaders:
            states[r.sample_index] = self._state(r)
            for c in r.pending_children:
                states[c.sample_index] = SampleState([], 0, [], [])
        out.state = TransferState.HANDING_OVER
        out.deadline = out.paused_at + self.timeout
        *chunks, final = self._chunks(rest)
        for chunk in chunks:
            if not self._send_blocks(out, Blocks(out.transfer_id, chunk), chunk):
                return
        self._send_blocks(out, Handover(out.transfer_id, self.address, final, states), final)

    def _state(self, r: Request) -> SampleState:
        return SampleState(
            output_token_ids=r.output_token_ids,
            num_computed_tokens=r.num_computed_tokens,
            block_ids=r.block_ids[: -(-r.num_computed_tokens // self.host.block_size)],
            pending=[c.sample_index for c in r.pending_children],
            num_preemptions=r.num_preemptions,
            num_cached_tokens=r.num_cached_tokens,
            protected_until_outputs=r.protected_until_outputs,
            first_scheduled_time=r.first_scheduled_time,
            first_token_time=r.first_token_time,
            prompt_logprobs_next=r.prompt_logprobs_next,
        )

    # -- ending ---------------------------------------------------------------------------------

    def _abort(
        self, out: Outgoing, reason: str, cancel: bool = True, outcome: MoveOutcome = MoveOutcome.ABORTED
    ) -> None:
        """Give the transfer up: the request goes on here; the destination drops what it has."""
        if self.transfers.pop(out.transfer_id, None) is None:
            return
        for r in out.paused:
            if r.status == RequestStatus.PAUSED:
                self.host.unpause(r)
        self._release(out)
        self._note("end", out.request_id, outcome=outcome.value, stages=out.num_stages)
        if cancel:
            # An unreachable destination times the transfer out on its own.
            with contextlib.suppress(Exception):
                self.send(out.peer, Cancel(out.transfer_id), None)
        logger.info("move of %s %s: %s", out.request_id, outcome.value, reason)
        self.report(
            Migrated(out.request_id, out.transfer_id, outcome, reason, out.num_bytes, out.num_stages)
        )

    def _release(self, out: Outgoing) -> None:
        self.host.drop_blocks(list(out.held))
        out.held.clear()
        out.queued.clear()
