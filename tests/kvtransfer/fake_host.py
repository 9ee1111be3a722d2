"""An engine reduced to what the KV plane sees (`tandem.kvtransfer.host.KVHost`), and an in-memory
network between planes: the sender and receiver run as in an engine, against no model and no
torch, step by step and message by message, as tests/scheduler_harness.py drives the scheduler.

`FakeHost` keeps real `Request`s with block tables over a real `BlockPool`, and a KV store in which
every slot holds the (position, token) computed there. Its "model" reads a request's whole history
back through the block table before it samples the next token from it (asserting it is exactly
the request's tokens), so a block copied wrong, mapped wrong or freed too early shows up as an
assertion or as tokens that differ from a run that never moved. It counts the tokens whose KV it
computed for each request (`computed`): a destination that installs a moved request must compute
only the tokens sampled after the move, never its context again.

`Network` holds each message in its destination's queue until the test delivers it, so a test
decides exactly what each side has heard when.
"""

from __future__ import annotations

import struct
from collections import Counter, deque
from collections.abc import Sequence
from typing import Any

from tandem.core.block_pool import BlockPool
from tandem.core.engine_io import EngineCoreRequest
from tandem.core.request import Request, RequestStatus
from tandem.kvtransfer.protocol import SampleState
from tandem.kvtransfer.transport import Message, TransportError
from tandem.sampling_params import SamplingParams

# What a KV slot holds here: the position and the token computed there.
SLOT = struct.Struct("<ii")
VOCAB = 997


def next_token(history: list[int]) -> int:
    h = len(history)
    for t in history:
        h = (h * 1_000_003 + t + 1) & 0xFFFFFFFFFFFF
    return (h >> 5) % VOCAB


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    """The tokens a request produces on an engine it never leaves."""
    toks = list(prompt)
    while len(toks) - len(prompt) < max_tokens:
        toks.append(next_token(toks))
    return toks[len(prompt) :]


class FakeHost:
    def __init__(
        self,
        num_blocks: int = 64,
        block_size: int = 4,
        max_seqs: int = 4,
        max_model_len: int = 4096,
        kv_format_name: str = "fake",
    ) -> None:
        self.block_size = block_size
        self.kv_block_bytes = block_size * SLOT.size
        self.kv_format_name = kv_format_name
        self.pool = BlockPool(num_blocks)
        self.kv = bytearray(num_blocks * self.kv_block_bytes)
        self.max_seqs = max_seqs
        self.max_model_len = max_model_len
        self.reserved_seats = 0
        self.groups: dict[str, list[Request | None]] = {}
        self.runs: dict[str, int] = {}
        # Tokens whose KV this host computed, per request.
        self.computed: Counter[str] = Counter()
        # Prompt tokens per step for requests still computing their prompt (chunked prefill).
        self.chunk: dict[str, int] = {}
        self.fail_writes = False

    # -- driving it ----------------------------------------------------------------------------

    def add(
        self,
        rid: str,
        prompt: list[int],
        max_tokens: int,
        chunk: int | None = None,
        waiting: bool = False,
    ) -> Request:
        """A request; unless `chunk` (prompt tokens per step) its prompt is computed now and its
        first token sampled; `waiting`: it waits until `admit`."""
        req = Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True), max_tokens)
        self.groups[rid] = [req]
        self.runs[rid] = 0
        self.chunk[rid] = chunk or len(prompt)
        if not waiting:
            self.admit(rid)
        return req

    def admit(self, rid: str) -> None:
        req = self.leader(rid)
        req.status = RequestStatus.RUNNING
        if self.chunk[rid] >= len(req.prompt_token_ids):
            self._compute(req)

    def leader(self, rid: str) -> Request:
        group = self.groups[rid]
        assert group[0] is not None
        return group[0]

    def step(self) -> dict[str, list[int]]:
        """One engine step: each running request computes its next tokens; the tokens sampled."""
        out: dict[str, list[int]] = {}
        for rid, group in list(self.groups.items()):
            req = group[0]
            if req is None or req.status != RequestStatus.RUNNING:
                continue
            before = req.num_output_tokens
            self._compute(req)
            out[rid] = req.output_token_ids[before:]
            if req.num_output_tokens >= req.max_tokens:
                self.abort_requests([rid])
        return out

    def _compute(self, req: Request) -> None:
        """Write the KV of the tokens due (a prompt chunk, or the last sampled token), and sample
        one if the prompt is done."""
        rid = req.group_id
        prompt = len(req.prompt_token_ids)
        if req.num_computed_tokens < prompt:
            end = min(prompt, req.num_computed_tokens + self.chunk[rid])
        else:
            end = req.num_tokens
        for pos in range(req.num_computed_tokens, end):
            if pos // self.block_size >= len(req.block_ids):
                req.block_ids += self.pool.allocate(1)
            self._write_slot(req.block_ids[pos // self.block_size], pos % self.block_size, pos, req.token_ids[pos])
        self.computed[rid] += end - req.num_computed_tokens
        req.num_computed_tokens = end
        if end >= prompt and end == req.num_tokens:
            history = self.history(req)
            assert history == req.token_ids, f"{rid}: its KV does not hold its tokens"
            req.token_ids.append(next_token(history))

    def _write_slot(self, block: int, offset: int, pos: int, token: int) -> None:
        at = block * self.kv_block_bytes + offset * SLOT.size
        self.kv[at : at + SLOT.size] = SLOT.pack(pos, token)

    def history(self, req: Request) -> list[int]:
        """The tokens the request's KV holds, read through its block table."""
        toks = []
        for pos in range(req.num_computed_tokens):
            block = req.block_ids[pos // self.block_size]
            at = block * self.kv_block_bytes + (pos % self.block_size) * SLOT.size
            where, token = SLOT.unpack_from(self.kv, at)
            assert where == pos, f"{req.request_id}: slot of position {pos} holds position {where}"
            toks.append(token)
        return toks

    def tokens(self, rid: str) -> list[int]:
        return self.leader(rid).output_token_ids

    def seats_taken(self) -> int:
        live = [r for g in self.groups.values() for r in g if r is not None]
        busy = (RequestStatus.RUNNING, RequestStatus.PAUSED)
        return sum(r.num_seats for r in live if r.status in busy) + self.reserved_seats

    def check_idle(self) -> None:
        assert not self.groups, self.groups
        assert self.reserved_seats == 0
        assert self.pool.num_free == self.pool.num_blocks, "KV blocks leaked"
        self.pool.check_invariants()

    # -- KVHost ---------------------------------------------------------------------------------

    def samples(self, request_id: str) -> list[Request | None] | None:
        return self.groups.get(request_id)

    def incarnation(self, request_id: str) -> int | None:
        return self.runs.get(request_id)

    def pause(self, req: Request) -> None:
        assert req.status == RequestStatus.RUNNING, req.status
        req.status = RequestStatus.PAUSED

    def unpause(self, req: Request) -> None:
        assert req.status == RequestStatus.PAUSED, req.status
        req.status = RequestStatus.RUNNING

    def abort_requests(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            for r in self.groups.pop(rid, None) or []:
                if r is not None:
                    self.pool.free(r.block_ids)
                    r.block_ids = []
                    r.status = RequestStatus.FINISHED_ABORTED
            self.runs.pop(rid, None)
            self.chunk.pop(rid, None)

    def admission_error(self, req: EngineCoreRequest) -> str | None:
        if len(req.prompt_token_ids) + req.max_tokens > self.max_model_len:
            return "longer than max_model_len"
        return None

    def reserve_seats(self, n: int) -> bool:
        if self.seats_taken() + n > self.max_seqs:
            return False
        self.reserved_seats += n
        return True

    def release_seats(self, n: int) -> None:
        self.reserved_seats -= n
        assert self.reserved_seats >= 0

    def reserve_blocks(self, n: int) -> list[int] | None:
        return self.pool.allocate(n) if n <= self.pool.num_free else None

    def install(self, req: EngineCoreRequest, samples: Sequence[SampleState | None]) -> None:
        if req.request_id in self.groups:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        assert len(samples) == 1 and samples[0] is not None, "the fake runs one sample a request"
        st = samples[0]
        params = SamplingParams(max_tokens=req.max_tokens, ignore_eos=True)
        r = Request(req.request_id, list(req.prompt_token_ids), params, req.max_tokens)
        r.token_ids = [*req.prompt_token_ids, *st.output_token_ids]
        r.num_computed_tokens = st.num_computed_tokens
        r.block_ids = list(st.block_ids)
        r.status = RequestStatus.RUNNING
        self.pool.incref(r.block_ids)
        self.groups[req.request_id] = [r]
        self.runs[req.request_id] = req.incarnation
        self.chunk[req.request_id] = len(req.prompt_token_ids)

    def hold_blocks(self, block_ids: list[int]) -> None:
        self.pool.incref(block_ids)

    def drop_blocks(self, block_ids: list[int]) -> None:
        self.pool.free(block_ids)

    def read_blocks(self, block_ids: list[int]) -> bytes:
        n = self.kv_block_bytes
        return b"".join(bytes(self.kv[b * n : (b + 1) * n]) for b in block_ids)

    def write_blocks(self, block_ids: list[int], payload: memoryview) -> None:
        n = self.kv_block_bytes
        if self.fail_writes or payload.nbytes != n * len(block_ids):
            raise ValueError(f"KV payload of {payload.nbytes} bytes for {len(block_ids)} blocks")
        data = bytes(payload)
        for i, b in enumerate(block_ids):
            self.kv[b * n : (b + 1) * n] = data[i * n : (i + 1) * n]


class Network:
    """Inboxes by address; a message waits in its destination's until `Transport.recv` takes it."""

    def __init__(self) -> None:
        self.inboxes: dict[str, deque[Message]] = {}
        self.down: set[str] = set()  # addresses nobody reads any more (sends to them fail)

    def transport(self, address: str) -> LoopTransport:
        self.inboxes[address] = deque()
        return LoopTransport(self, address)

    def pending(self, address: str) -> int:
        return len(self.inboxes[address])


class LoopTransport:
    socket: Any = None

    def __init__(self, network: Network, address: str) -> None:
        self.network = network
        self.address = address

    def send(self, peer: str, header: bytes, payload: Any = None) -> None:
        inbox = self.network.inboxes.get(peer)
        if inbox is None or peer in self.network.down:
            raise TransportError(f"KV peer {peer} is not taking messages")
        # Copied, as a transport does: the sender may reuse its buffer at once.
        data = None if payload is None else memoryview(bytes(memoryview(payload)))
        inbox.append(Message(header, data))

    def recv(self) -> Message | None:
        inbox = self.network.inboxes[self.address]
        return inbox.popleft() if inbox else None

    def close(self) -> None:
        self.network.down.add(self.address)
