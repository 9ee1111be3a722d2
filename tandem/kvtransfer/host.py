"""The port between the KV plane and the engine it runs in: what a sender and a receiver may ask of
their engine, and nothing else. `tandem.engine.core.EngineCore` implements it; the tests' fake
host (tests/kvtransfer/fake_host.py) implements it without a model.

The plane reads a request's samples (`Request`s, as the scheduler holds them) but changes them
only through these calls: pausing and unpausing, ending the request here, and installing a
request whose KV arrived. Blocks are the engine's KV block ids; a block the plane holds has one
reference of the plane's own, which it drops when the transfer ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from tandem.core.engine_io import EngineCoreRequest
from tandem.core.request import Request
from tandem.kvtransfer.protocol import SampleState


class KVHost(Protocol):
    # Tokens per KV block, bytes of one block (every layer, K and V, scales included), and what
    # the blocks hold (KVCacheFormat.name: both ends of a transfer must hold the same).
    block_size: int
    kv_block_bytes: int
    kv_format_name: str

    # -- the requests it runs ---------------------------------------------------------------------

    def samples(self, request_id: str) -> list[Request | None] | None:
        """A request's samples (None: one that has ended), or None if it is not here."""
        ...

    def incarnation(self, request_id: str) -> int | None:
        """The front end's run of the request this engine has."""
        ...

    def pause(self, req: Request) -> None:
        """Take a running sample out of the batch; it keeps its blocks and seat."""
        ...

    def unpause(self, req: Request) -> None: ...

    def abort_requests(self, request_ids: list[str]) -> None:
        """End requests here without a word to the front end (handed over, or a copy not wanted)."""
        ...

    # -- taking a request in ----------------------------------------------------------------------

    def admission_error(self, req: EngineCoreRequest) -> str | None:
        """Why this engine could never run `req` (its limits), or None."""
        ...

    def reserve_seats(self, n: int) -> bool:
        """Promise `n` sequence seats to a request on its way here; False if they are not free."""
        ...

    def release_seats(self, n: int) -> None: ...

    def reserve_blocks(self, n: int) -> list[int] | None:
        """`n` free blocks, held by the caller (idle cached prefixes evicted if need be), or None."""
        ...

    def install(self, req: EngineCoreRequest, samples: Sequence[SampleState | None]) -> None:
        """Run a request whose KV is in this engine's blocks (`SampleState.block_ids` are its own):
        each sample takes a reference on its blocks; its seats were reserved."""
        ...

    # -- blocks ------------------------------------------------------------------------------------

    def hold_blocks(self, block_ids: list[int]) -> None:
        """One more reference on each (a block sent is not reused while the destination maps it)."""
        ...

    def drop_blocks(self, block_ids: list[int]) -> None:
        """Drop one reference on each (freed, or back to the prefix cache, at zero)."""
        ...

    def read_blocks(self, block_ids: list[int]) -> Any:
        """These blocks' KV as one contiguous byte buffer (the wire's payload)."""
        ...

    def write_blocks(self, block_ids: list[int], payload: memoryview) -> None:
        """Write what `read_blocks` gave on another engine into these blocks; ValueError if the
        payload does not fit them."""
        ...
