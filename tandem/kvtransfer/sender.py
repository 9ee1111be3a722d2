"""The source end of a live migration: copy a running request's KV in stages, pause it, hand it over.

While the request keeps decoding here, each stage sends the full blocks computed since the last one
(full computed blocks never change, so what was sent stays valid). Once few new blocks are left (or
after `migration_max_stages` stages) the request is paused, and its last blocks (the partly filled
one included) go with its state in the hand-over. The destination installs it and says so; only
then is it released here and the front end told (`Migrated`), so exactly one instance owns the
request at any time. If the destination refuses, fails, dies (the front end sends MigrateCancel)
or stays silent past the timeout, the request is unpaused and goes on here; the destination frees
what it reserved on Cancel (or on its own timeout).

Every block a stage sent holds an extra reference until the transfer ends, so its id cannot be
reused for other tokens while the destination still maps it.

A prefill/decode hand-off (`after_prefill`) is the same transfer started with the request's Add:
the destination reserves the prompt's blocks at once, each step's newly computed full blocks go as
a stage (the copy overlaps the prefill, chunk by chunk, with no stage limit), and the hand-over
comes as soon as the first token is sampled. While the request waits or computes without filling
a block, empty stages every third of the timeout tell the destination the source lives.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tandem.core.request import Request, RequestStatus
from tandem.engine import messages as m
from tandem.kvtransfer import wire
from tandem.kvtransfer.transport import MAX_PAYLOAD_BYTES

if TYPE_CHECKING:
    from tandem.engine.core import EngineCore

logger = logging.getLogger("tandem.kvtransfer")

ACCEPTING, COPYING, HANDING_OVER = "accepting", "copying", "handing over"


@dataclass(slots=True)
class Outgoing:
    transfer_id: str
    request_id: str
    peer: str
    state: str
    deadline: float
    started: float
    sent: dict[int, None] = field(default_factory=dict)  # source block ids sent (and held)
    paused: list[Request] = field(default_factory=list)
    paused_at: float = 0.0
    num_stages: int = 0
    num_bytes: int = 0
    handoff: bool = False  # prefill/decode: hand over at the first token
    last_sent: float = 0.0


class Sender:
    def __init__(
        self,
        core: EngineCore,
        address: str,
        send: Callable[[str, Any, Any], None],
        report: Callable[[m.Migrated], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.core = core
        self.address = address
        self.send = send
        self.report = report
        self.clock = clock
        cfg = core.config
        self.timeout = cfg.kv_transfer_timeout_s
        self.max_stages = cfg.migration_max_stages
        self.stop_blocks = cfg.migration_stop_blocks
        self.transfers: dict[str, Outgoing] = {}
        self.block_bytes = core.runner.kv_bytes_per_block(
            core.model_config, core.kv.block_size, core.runner.kv_format
        )

    @property
    def active(self) -> bool:
        return bool(self.transfers)

    def start(self, msg: m.MigrateOut) -> None:
        req = msg.request
        rid = req.request_id
        now = self.clock()
        if msg.transfer_id in self.transfers or any(t.request_id == rid for t in self.transfers.values()):
            self._refuse(msg, "already migrating")
            return
        bs = self.core.kv.block_size
        leaders = self._leaders(rid)
        if msg.after_prefill:
            if self.core.samples(rid) is None:
                self._refuse(msg, "not_found")
                return
            # The prompt's blocks, and one more per sample for its first tokens after the fork.
            num_seats = req.params.n
            num_blocks = -(-len(req.prompt_token_ids) // bs) + req.params.n
        elif leaders is None:
            self._refuse(msg, "not_running")
            return
        else:
            computed = self._unique(b for r in leaders for b in r.block_ids[: -(-r.num_computed_tokens // bs)])
            num_seats = sum(r.num_seats for r in leaders)
            num_blocks = len(computed) + len(leaders)
        # A hand-off streams its stages without waiting for Accepted: the destination reads them
        # after the Begin (one ordered channel) and drops them if it refused.
        state = COPYING if msg.after_prefill else ACCEPTING
        out = Outgoing(msg.transfer_id, rid, msg.peer, state, now + self.timeout, now)
        out.handoff = msg.after_prefill
        out.last_sent = now
        self.transfers[msg.transfer_id] = out
        begin = wire.Begin(
            transfer_id=msg.transfer_id,
            reply_to=self.address,
            request=req,
            num_seats=num_seats,
            num_blocks=num_blocks,
            block_bytes=self.block_bytes,
            kv_cache_dtype=self.core.runner.kv_format.name,
        )
        self._send(out, begin)

    def _refuse(self, msg: m.MigrateOut, reason: str) -> None:
        self.report(m.Migrated(msg.request.request_id, msg.transfer_id, False, reason))

    def _leaders(self, rid: str) -> list[Request] | None:
        """The request's running samples that hold blocks (forks pending on them ride along), or
        None if it is not wholly running here (waiting, preempted, paused or gone)."""
        samples = self.core.samples(rid)
        if samples is None:
            return None
        live = [r for r in samples if r is not None]
        leaders = [r for r in live if r.status in (RequestStatus.RUNNING, RequestStatus.PAUSED)]
        pending = {id(c) for r in leaders for c in r.pending_children}
        if not leaders or any(id(r) not in pending and r not in leaders for r in live):
            return None
        return leaders

    @staticmethod
    def _unique(blocks: Any) -> list[int]:
        return list(dict.fromkeys(blocks))

    def _send(self, out: Outgoing, msg: Any, payload: Any = None) -> bool:
        try:
            self.send(out.peer, msg, payload)
        except Exception as exc:  # a peer we cannot reach ends this transfer only
            self._abort(out, f"send failed: {exc}")
            return False
        return True

    # -- replies from the destination ---------------------------------------

    def _answered(self, msg: wire.Accepted | wire.Installed, state: str) -> Outgoing | None:
        """The transfer a destination's answer is about, if the answer is yes and the transfer is in
        `state`; a no ends the transfer (the request stays here)."""
        out = self.transfers.get(msg.transfer_id)
        if out is None:
            return None
        if not msg.ok:
            # A no to Begin is a refusal (nothing was copied); a no to the hand-over, a failure.
            self._abort(out, msg.reason, cancel=False, refused=isinstance(msg, wire.Accepted))
            return None
        return out if out.state == state else None

    def on_accepted(self, msg: wire.Accepted) -> None:
        out = self._answered(msg, ACCEPTING)
        if out is None:
            return
        out.state = COPYING
        out.deadline = self.clock() + self.timeout
        self._advance(out)

    def on_installed(self, msg: wire.Installed) -> None:
        out = self._answered(msg, HANDING_OVER)
        if out is None:
            return
        del self.transfers[out.transfer_id]
        self._release(out)
        # The destination runs it now: end it here without a word to the front end (but this).
        self.core.abort_requests([out.request_id])
        downtime = self.clock() - out.paused_at
        self.report(
            m.Migrated(
                out.request_id,
                out.transfer_id,
                True,
                "",
                downtime,
                out.num_bytes,
                out.num_stages,
                transfer_s=self.clock() - out.started,
            )
        )

    def cancel(self, request_id: str, transfer_id: str) -> None:
        """The front end gives the transfer up (its destination died): the request stays here."""
        out = self.transfers.get(transfer_id)
        if out is not None:
            self._abort(out, "the destination is gone")

    # -- between steps --------------------------------------------------------

    def tick(self) -> None:
        now = self.clock()
        for out in list(self.transfers.values()):
            if out.state == COPYING:
                self._advance(out)
            elif self.core.samples(out.request_id) is None:  # aborted meanwhile (the client left)
                self._abort(out, "the request ended")
            elif now > out.deadline:
                self._abort(out, f"no answer from the destination in {self.timeout:g}s")

    def _advance(self, out: Outgoing) -> None:
        """Send the next stage, or pause the request and hand it over."""
        leaders = self._leaders(out.request_id)
        if leaders is None:
            if out.handoff and self.core.samples(out.request_id) is not None:
                self._heartbeat(out)  # waiting (or preempted): its prefill has not run yet
                return
            self._abort(out, "the request ended or was preempted")
            return
        bs = self.core.kv.block_size
        new = [
            b
            for b in self._unique(b for r in leaders for b in r.block_ids[: r.num_computed_tokens // bs])
            if b not in out.sent
        ]
        if out.handoff:
            prefilled = all(r.num_output_tokens >= 1 and not r.pending_children for r in leaders)
            stage = bool(new) and not prefilled
        else:
            prefilled = False
            stage = len(new) > self.stop_blocks and out.num_stages < self.max_stages
        if stage:
            for chunk in self._chunks(new):
                if not self._send_blocks(out, wire.Blocks(out.transfer_id, chunk), chunk):
                    return
                self.core.kv.pool.incref(chunk)
                out.sent.update(dict.fromkeys(chunk))
            out.num_stages += 1
            out.last_sent = self.clock()
            return
        if out.handoff and not prefilled:
            self._heartbeat(out)
            return
        self._hand_over(out, leaders)

    def _heartbeat(self, out: Outgoing) -> None:
        now = self.clock()
        if now - out.last_sent > self.timeout / 3:
            out.last_sent = now
            self._send(out, wire.Blocks(out.transfer_id, []))

    def _chunks(self, blocks: list[int]) -> list[list[int]]:
        """`blocks` split into messages of at most MAX_PAYLOAD_BYTES (at least one, maybe empty)."""
        per = max(1, MAX_PAYLOAD_BYTES // self.block_bytes)
        return [blocks[i : i + per] for i in range(0, len(blocks), per)] or [[]]

    def _send_blocks(self, out: Outgoing, msg: Any, blocks: list[int]) -> bool:
        data = self.core.runner.read_blocks(blocks) if blocks else None
        if data is not None:
            out.num_bytes += data.numel() * data.element_size()
        return self._send(out, msg, data)

    def _hand_over(self, out: Outgoing, leaders: list[Request]) -> None:
        core = self.core
        bs = core.kv.block_size
        for r in leaders:
            core.scheduler.pause(r)
        out.paused = leaders
        out.paused_at = self.clock()
        last = [
            b
            for b in self._unique(b for r in leaders for b in r.block_ids[: -(-r.num_computed_tokens // bs)])
            if b not in out.sent
        ]
        samples = core.samples(out.request_id) or []
        states: list[wire.SampleState | None] = [None] * len(samples)
        for r in leaders:
            states[r.sample_index] = self._state(r, bs)
            for c in r.pending_children:
                states[c.sample_index] = wire.SampleState([], 0, [], [])
        out.state = HANDING_OVER
        out.deadline = out.paused_at + self.timeout
        *chunks, final = self._chunks(last)
        for chunk in chunks:
            if not self._send_blocks(out, wire.Blocks(out.transfer_id, chunk), chunk):
                return
        self._send_blocks(out, wire.Handover(out.transfer_id, self.address, final, states), final)

    def _state(self, r: Request, bs: int) -> wire.SampleState:
        return wire.SampleState(
            output_token_ids=r.output_token_ids,
            num_computed_tokens=r.num_computed_tokens,
            block_ids=r.block_ids[: -(-r.num_computed_tokens // bs)],
            pending=[c.sample_index for c in r.pending_children],
            num_preemptions=r.num_preemptions,
            num_cached_tokens=r.num_cached_tokens,
            protected_until_outputs=r.protected_until_outputs,
            first_scheduled_time=r.first_scheduled_time,
            first_token_time=r.first_token_time,
            prompt_logprobs_next=r.prompt_logprobs_next,
        )

    # -- ending ---------------------------------------------------------------

    def _abort(self, out: Outgoing, reason: str, cancel: bool = True, refused: bool = False) -> None:
        """Give the transfer up: the request goes on here; the destination drops what it has."""
        if self.transfers.pop(out.transfer_id, None) is None:
            return
        for r in out.paused:
            if r.status == RequestStatus.PAUSED:
                self.core.scheduler.unpause(r)
        self._release(out)
        if cancel:
            # An unreachable destination times the transfer out on its own.
            with contextlib.suppress(Exception):
                self.send(out.peer, wire.Cancel(out.transfer_id), None)
        logger.info("migration of %s %s: %s", out.request_id, "refused" if refused else "abandoned", reason)
        self.report(
            m.Migrated(
                out.request_id, out.transfer_id, False, reason, 0.0, out.num_bytes, out.num_stages, refused=refused
            )
        )

    def _release(self, out: Outgoing) -> None:
        self.core.kv.pool.free(list(out.sent))
        out.sent.clear()
