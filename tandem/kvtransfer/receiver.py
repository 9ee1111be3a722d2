"""The destination end of a move: reserve, receive blocks into the reservation, install.

`Begin` reserves the request's seats and the blocks it will arrive with before any byte is sent,
so a transfer never lands in a full pool (a later stage that outgrows the reservation takes more
blocks, or fails the transfer cleanly). Blocks are written as they arrive; a live migration's
stage ends with a message that asks for `Staged`, sent once it is written. `Handover` maps the
samples' block tables to the blocks here and has the engine install the request (its samples take
their own references; forked samples share blocks again), then releases what was reserved and is
not used; `Installed` tells the source. A transfer the source stops talking to is dropped after
the timeout; a `Cancel` for one already installed (the source gave up before it heard back)
aborts the installed run.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from tandem.core.engine_io import EngineCoreRequest
from tandem.kvtransfer.host import KVHost
from tandem.kvtransfer.protocol import (
    Accepted,
    Begin,
    Blocks,
    Cancel,
    Handover,
    Installed,
    MoveLog,
    SampleState,
    Staged,
    TransferDropped,
)

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
        host: KVHost,
        send: Callable[[str, Any, Any], None],
        report: Callable[[TransferDropped], None],
        *,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        log: MoveLog | None = None,
    ) -> None:
        self.host = host
        self.log = log
        self.send = send
        self.report = report
        self.clock = clock
        self.timeout = timeout_s
        self.transfers: dict[str, Incoming] = {}
        self.installed: OrderedDict[str, tuple[str, int]] = OrderedDict()  # transfer -> (request, run)

    @property
    def active(self) -> bool:
        return bool(self.transfers)

    def _reply(self, to: str, msg: Any) -> None:
        try:
            self.send(to, msg, None)
        except Exception as exc:  # the source times the transfer out on its own
            logger.warning("cannot answer %s: %s", to, exc)

    def on_begin(self, msg: Begin) -> None:
        reason = self._refusal(msg)
        if reason is None:
            reason = self._reserve(msg)
        if reason is None and self.log is not None:
            self.log("accept", msg.request.request_id, self.clock(), blocks=msg.num_blocks, seats=msg.num_seats)
        self._reply(msg.reply_to, Accepted(msg.transfer_id, reason is None, reason or ""))

    def _refusal(self, msg: Begin) -> str | None:
        host = self.host
        req = msg.request
        if msg.transfer_id in self.transfers or host.samples(req.request_id) is not None:
            return f"request {req.request_id} is already here"
        if msg.kv_cache_dtype != host.kv_format_name:
            # Same-sized blocks of another format (int8 and fp8; bfloat16 and float16) would be
            # written without complaint and read as garbage.
            return (
                f"KV cache dtype {msg.kv_cache_dtype} does not match this instance's {host.kv_format_name} "
                "(both ends need the same kv_cache_dtype and dtype)"
            )
        if msg.block_bytes != host.kv_block_bytes:
            return f"KV blocks of {msg.block_bytes} bytes do not match this instance's {host.kv_block_bytes}"
        return host.admission_error(req)

    def _reserve(self, msg: Begin) -> str | None:
        """Take the transfer's seats and blocks; why not, if they are not free."""
        if not self.host.reserve_seats(msg.num_seats):
            return "no free sequence slot"
        blocks = self.host.reserve_blocks(msg.num_blocks)
        if blocks is None:
            self.host.release_seats(msg.num_seats)
            return f"no room for {msg.num_blocks} KV blocks"
        deadline = self.clock() + self.timeout
        self.transfers[msg.transfer_id] = Incoming(
            msg.transfer_id, msg.request, msg.reply_to, msg.num_seats, deadline, reserved=blocks
        )
        return None

    def on_blocks(self, msg: Blocks, payload: memoryview | None) -> None:
        inc = self.transfers.get(msg.transfer_id)
        if inc is None:
            return  # given up here already; the source hears so at its hand-over
        try:
            self._receive(inc, msg.block_ids, payload)
        except TransferFailed as exc:
            self._drop(inc)
            self._reply(inc.reply_to, Installed(inc.transfer_id, False, str(exc)))
            return
        if msg.ack:
            self._reply(inc.reply_to, Staged(inc.transfer_id))

    def _receive(self, inc: Incoming, block_ids: list[int], payload: memoryview | None) -> None:
        inc.deadline = self.clock() + self.timeout  # an empty stage is the source's heartbeat
        new = [b for b in block_ids if b not in inc.mapped]
        short = len(new) - len(inc.reserved)
        if short > 0:
            more = self.host.reserve_blocks(short)
            if more is None:
                raise TransferFailed(f"no room for {short} more KV blocks")
            inc.reserved += more
        for b in new:
            inc.mapped[b] = inc.reserved.pop()
        if payload is None:
            if block_ids:
                raise TransferFailed("blocks without a payload")
            return
        try:
            self.host.write_blocks([inc.mapped[b] for b in block_ids], payload)
        except ValueError as exc:
            raise TransferFailed(str(exc)) from exc
        inc.num_bytes += payload.nbytes

    def on_handover(self, msg: Handover, payload: memoryview | None) -> None:
        inc = self.transfers.get(msg.transfer_id)
        if inc is None:  # dropped here (timeout, a failed stage): the request stays with its source
            self._reply(msg.reply_to, Installed(msg.transfer_id, False, "the transfer was dropped"))
            return
        try:
            self._receive(inc, msg.block_ids, payload)
            samples = self._mapped(inc, msg.samples)
            self.host.install(inc.request, samples)
        except (TransferFailed, ValueError) as exc:
            self._drop(inc)
            self._reply(inc.reply_to, Installed(inc.transfer_id, False, str(exc)))
            return
        # The samples hold their blocks now: the transfer's own references go, and blocks no sample
        # uses return to the pool.
        del self.transfers[inc.transfer_id]
        self.host.drop_blocks(list(inc.mapped.values()) + inc.reserved)
        self.host.release_seats(inc.seats)
        if self.log is not None:
            self.log("install", inc.request.request_id, self.clock(), blocks=len(inc.mapped))
        self.installed[inc.transfer_id] = (inc.request.request_id, inc.request.incarnation)
        while len(self.installed) > REMEMBERED_INSTALLS:
            self.installed.popitem(last=False)
        self._reply(inc.reply_to, Installed(inc.transfer_id, True))

    def _mapped(self, inc: Incoming, samples: list[SampleState | None]) -> list[SampleState | None]:
        """The samples with their block tables in this engine's block ids."""
        if len(samples) != inc.request.params.n:
            raise TransferFailed(f"{len(samples)} samples for n={inc.request.params.n}")
        try:
            return [
                None if st is None else msgspec.structs.replace(st, block_ids=[inc.mapped[b] for b in st.block_ids])
                for st in samples
            ]
        except KeyError as exc:
            raise TransferFailed(f"block {exc} of a sample was never sent") from exc

    def on_cancel(self, msg: Cancel) -> None:
        inc = self.transfers.get(msg.transfer_id)
        if inc is not None:
            self._drop(inc)
            return
        done = self.installed.pop(msg.transfer_id, None)
        if done is not None and self.host.incarnation(done[0]) == done[1]:
            self.host.abort_requests([done[0]])

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
            self.report(TransferDropped(inc.request.request_id, inc.transfer_id, reason))
        return bool(expired)

    def _drop(self, inc: Incoming) -> None:
        if self.transfers.pop(inc.transfer_id, None) is None:
            return
        self.host.drop_blocks(list(inc.mapped.values()) + inc.reserved)
        self.host.release_seats(inc.seats)
        inc.mapped.clear()
        inc.reserved.clear()
