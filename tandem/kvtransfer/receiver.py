"""The destination end of a transfer: reserve, receive blocks into the reservation, install.

`Begin` reserves the request's seats and the blocks it will arrive with before any byte is sent,
so a transfer never lands in a full pool (a later stage that outgrows the reservation takes more
blocks, or fails the transfer cleanly). Blocks are written as they arrive. `Handover` builds the
request's samples over the received blocks (forked samples share them again), releases what was
reserved and not used, and adopts the request into the running set; `Installed` tells the source.
A transfer the source stops talking to is dropped after the timeout; a `Cancel` for one already
installed (the source gave up before it heard back) aborts the installed run.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tandem.core.request import Request
from tandem.engine import messages as m
from tandem.engine.messages import EngineCoreRequest
from tandem.kvtransfer import wire

if TYPE_CHECKING:
    from tandem.engine.core import EngineCore

logger = logging.getLogger("tandem.kvtransfer")

# Installed transfers remembered (for a late Cancel from their source).
REMEMBERED_INSTALLS = 1024


class TransferFailed(Exception):
    pass


@dataclass(slots=True)
class Incoming:
    transfer_id: str
    request: EngineCoreRequest
    reply_to: str
    seats: int
    deadline: float
    reserved: list[int] = field(default_factory=list)  # blocks held for blocks yet to come
    mapped: dict[int, int] = field(default_factory=dict)  # source block id -> block here
    num_bytes: int = 0


class Receiver:
    def __init__(
        self,
        core: EngineCore,
        send: Callable[[str, Any, Any], None],
        report: Callable[[Any], None] = lambda msg: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.core = core
        self.send = send
        self.report = report
        self.clock = clock
        self.timeout = core.config.kv_transfer_timeout_s
        self.transfers: dict[str, Incoming] = {}
        self.installed: OrderedDict[str, tuple[str, int]] = OrderedDict()  # transfer -> (request, run)
        self.block_bytes = core.runner.kv_bytes_per_block(
            core.model_config, core.kv.block_size, core.runner.kv_format
        )
        self.kv_cache_dtype = core.runner.kv_format.name

    @property
    def active(self) -> bool:
        return bool(self.transfers)

    def _reply(self, to: str, msg: Any) -> None:
        try:
            self.send(to, msg, None)
        except Exception as exc:  # the source times the transfer out on its own
            logger.warning("cannot answer %s: %s", to, exc)

    def on_begin(self, msg: wire.Begin) -> None:
        reason = self._refusal(msg)
        if reason is None:
            core = self.core
            core.scheduler.reserved_seats += msg.num_seats
            inc = Incoming(
                msg.transfer_id, msg.request, msg.reply_to, msg.num_seats, self.clock() + self.timeout
            )
            inc.reserved = core.kv.pool.allocate(msg.num_blocks)
            self.transfers[msg.transfer_id] = inc
        self._reply(msg.reply_to, wire.Accepted(msg.transfer_id, reason is None, reason or ""))

    def _refusal(self, msg: wire.Begin) -> str | None:
        core = self.core
        req = msg.request
        if msg.transfer_id in self.transfers or core.samples(req.request_id) is not None:
            return f"request {req.request_id} is already here"
        if msg.kv_cache_dtype != self.kv_cache_dtype:
            # Same-sized blocks of another format (int8 and fp8; bfloat16 and float16) would be
            # written without complaint and read as garbage.
            return (
                f"KV cache dtype {msg.kv_cache_dtype} does not match this instance's {self.kv_cache_dtype} "
                "(both ends need the same kv_cache_dtype and dtype)"
            )
        if msg.block_bytes != self.block_bytes:
            return f"KV blocks of {msg.block_bytes} bytes do not match this instance's {self.block_bytes}"
        try:
            core.limits.check(req.prompt_token_ids, req.max_tokens, req.params.n, req.params.stop_ids)
        except ValueError as exc:
            return str(exc)
        if core.scheduler.seats_taken + msg.num_seats > core.scheduler.max_num_seqs:
            return "no free sequence slot"
        if not core.kv.reserve(msg.num_blocks):
            return f"no room for {msg.num_blocks} KV blocks"
        return None

    def on_blocks(self, msg: wire.Blocks, payload: memoryview | None) -> None:
        inc = self.transfers.get(msg.transfer_id)
        if inc is None:
            return  # given up here already; the source hears so at its hand-over
        try:
            self._receive(inc, msg.block_ids, payload)
        except TransferFailed as exc:
            self._drop(inc)
            self._reply(inc.reply_to, wire.Installed(inc.transfer_id, False, str(exc)))

    def _receive(self, inc: Incoming, block_ids: list[int], payload: memoryview | None) -> None:
        inc.deadline = self.clock() + self.timeout  # an empty stage is the source's heartbeat
        kv = self.core.kv
        new = [b for b in block_ids if b not in inc.mapped]
        short = len(new) - len(inc.reserved)
        if short > 0:
            if not kv.reserve(short):
                raise TransferFailed(f"no room for {short} more KV blocks")
            inc.reserved += kv.pool.allocate(short)
        for b in new:
            inc.mapped[b] = inc.reserved.pop()
        if payload is None:
            if block_ids:
                raise TransferFailed("blocks without a payload")
            return
        try:
            self.core.runner.write_blocks([inc.mapped[b] for b in block_ids], payload)
        except ValueError as exc:
            raise TransferFailed(str(exc)) from exc
        inc.num_bytes += payload.nbytes

    def on_handover(self, msg: wire.Handover, payload: memoryview | None) -> None:
        inc = self.transfers.get(msg.transfer_id)
        if inc is None:  # dropped here (timeout, a failed stage): the request stays with its source
            self._reply(msg.reply_to, wire.Installed(msg.transfer_id, False, "the transfer was dropped"))
            return
        try:
            self._receive(inc, msg.block_ids, payload)
            members = self._members(inc, msg.samples)
        except (TransferFailed, KeyError) as exc:
            self._drop(inc)
            self._reply(inc.reply_to, wire.Installed(inc.transfer_id, False, str(exc) or "bad block table"))
            return
        core = self.core
        pool = core.kv.pool
        for r in members:
            if r is not None:
                pool.incref(r.block_ids)
        # The transfer's own references go; blocks no sample uses return to the pool.
        del self.transfers[inc.transfer_id]
        pool.free(list(inc.mapped.values()) + inc.reserved)
        core.scheduler.reserved_seats -= inc.seats
        core.install(inc.request, members)
        self.installed[inc.transfer_id] = (inc.request.request_id, inc.request.incarnation)
        while len(self.installed) > REMEMBERED_INSTALLS:
            self.installed.popitem(last=False)
        self._reply(inc.reply_to, wire.Installed(inc.transfer_id, True))

    def _members(self, inc: Incoming, samples: list[wire.SampleState | None]) -> list[Request | None]:
        core = self.core
        req = inc.request
        if len(samples) != req.params.n:
            raise TransferFailed(f"{len(samples)} samples for n={req.params.n}")
        members: list[Request | None] = []
        for i, st in enumerate(samples):
            if st is None:
                members.append(None)
                continue
            r = core.make_member(req, i, st.output_token_ids)
            r.num_computed_tokens = st.num_computed_tokens
            r.block_ids = [inc.mapped[b] for b in st.block_ids]
            r.num_preemptions = st.num_preemptions
            r.num_cached_tokens = st.num_cached_tokens
            r.protected_until_outputs = st.protected_until_outputs
            r.first_scheduled_time = st.first_scheduled_time
            r.first_token_time = st.first_token_time
            r.prompt_logprobs_next = max(r.prompt_logprobs_next, st.prompt_logprobs_next)
            members.append(r)
        for st, leader in zip(samples, members):
            if st is not None and leader is not None:
                leader.pending_children = [c for j in st.pending if (c := members[j]) is not None]
        return members

    def on_cancel(self, msg: wire.Cancel) -> None:
        inc = self.transfers.get(msg.transfer_id)
        if inc is not None:
            self._drop(inc)
            return
        done = self.installed.pop(msg.transfer_id, None)
        if done is not None and self.core.incarnation(done[0]) == done[1]:
            self.core.abort_requests([done[0]])

    def drop_request(self, request_id: str) -> None:
        """Forget any transfer of this request under way (the front end aborted it here)."""
        for inc in [t for t in self.transfers.values() if t.request.request_id == request_id]:
            self._drop(inc)

    def tick(self) -> bool:
        """Drop transfers whose source went silent; True if any was."""
        now = self.clock()
        expired = [t for t in self.transfers.values() if now > t.deadline]
        for inc in expired:
            logger.warning("KV transfer %s timed out; its blocks are released", inc.transfer_id)
            self._drop(inc)
            reason = f"no word from the source in {self.timeout:g}s"
            self.report(m.TransferDropped(inc.request.request_id, inc.transfer_id, reason))
        return bool(expired)

    def _drop(self, inc: Incoming) -> None:
        if self.transfers.pop(inc.transfer_id, None) is None:
            return
        self.core.kv.pool.free(list(inc.mapped.values()) + inc.reserved)
        self.core.scheduler.reserved_seats -= inc.seats
        inc.mapped.clear()
        inc.reserved.clear()
