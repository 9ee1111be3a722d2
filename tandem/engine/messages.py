"""What crosses the process boundary between the API process and the engine-core process.

Every message is a msgspec struct, encoded as MessagePack and sent over a ZeroMQ PUSH/PULL pair.
The payloads are plain data defined in `core` (`EngineCoreRequest` in and `SampleOutput` out in
core/engine_io.py, `EngineLimits`); the messages of a move between engines (MigrateOut,
MigrateCancel, Migrated, TransferDropped) are the migration protocol's, defined with the rest of
it in tandem/kvtransfer/protocol.py. Whoever sends or receives them imports data, never the engine.

API -> engine: Init (once), Add, Abort, StopSample, MigrateOut, MigrateCancel, Shutdown.
Engine -> API: Hello (once, process up), Ready (once, core built), Outputs (a step's deltas plus,
periodically, Stats), Rejected (an Add the core refused), Migrated (a MigrateOut's outcome),
TransferDropped (a destination gave an incoming transfer up), Failed (fatal error, then the process exits).
"""

from __future__ import annotations

import msgspec

from tandem.core.engine_io import EngineCoreRequest, SampleOutput
from tandem.core.limits import EngineLimits
from tandem.core.stats import EngineCounters
from tandem.kvtransfer.protocol import MigrateCancel, Migrated, MigrateOut, TransferDropped

__all__ = [
    "Abort",
    "Add",
    "EngineCoreRequest",
    "Failed",
    "FromEngine",
    "Hello",
    "Init",
    "MigrateCancel",
    "MigrateOut",
    "Migrated",
    "Outputs",
    "Ready",
    "Rejected",
    "SampleOutput",
    "Shutdown",
    "Stats",
    "StopSample",
    "ToEngine",
    "TransferDropped",
    "client_decoder",
    "encoder",
    "engine_decoder",
]


# -- API process -> engine ---------------------------------------------------


class Init(msgspec.Struct, tag="init"):
    extra_eos_token_ids: list[int]


class Add(msgspec.Struct, tag="add"):
    request: EngineCoreRequest


class Abort(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class StopSample(msgspec.Struct, tag="stop"):
    request_id: str
    index: int
    reason: str


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


# -- engine -> API process ---------------------------------------------------


class Hello(msgspec.Struct, tag="hello"):
    pid: int


class Ready(msgspec.Struct, tag="ready"):
    pid: int
    limits: EngineLimits
    # The engine's KV block size and whether it caches prefixes (what prefix-aware dispatch needs).
    prefix_caching: bool = False
    # Where other engines send it KV (tandem/kvtransfer); None: it takes no transfers.
    kv_address: str | None = None


class Stats(msgspec.Struct):
    """An instance's report: its load (for the dispatcher and the migration policy; the gauges) and
    the engine's counters (`tandem.core.stats.EngineCounters`: cumulative since start, histograms
    since the previous report)."""

    num_running: int
    num_waiting: int
    kv_usage: float
    counters: EngineCounters = msgspec.field(default_factory=EngineCounters)
    # Load, for a dispatcher across instances: KV blocks in all and obtainable now (free, or
    # cached and idle), and a summary of the prefix cache (`PrefixCache.block_hashes`), sent only
    # when it changed since the previous snapshot that carried one (None: unchanged).
    num_blocks: int = 0
    num_available_blocks: int = 0
    prefix_hashes: list[int] | None = None
    # Sequence seats taken (running and paused samples, seats reserved for incoming transfers) and
    # the bound, max_num_seqs (0: not reported): a migration goes only where a seat is free.
    num_seats_taken: int = 0
    max_num_seqs: int = 0


class Outputs(msgspec.Struct, tag="outputs"):
    outputs: list[SampleOutput]
    stats: Stats | None = None


class Rejected(msgspec.Struct, tag="rejected"):
    request_id: str
    message: str


class Failed(msgspec.Struct, tag="failed"):
    message: str


ToEngine = Init | Add | Abort | StopSample | MigrateOut | MigrateCancel | Shutdown
FromEngine = Hello | Ready | Outputs | Rejected | Migrated | TransferDropped | Failed


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def engine_decoder() -> msgspec.msgpack.Decoder:
    """Decodes what the engine receives."""
    return msgspec.msgpack.Decoder(ToEngine)


def client_decoder() -> msgspec.msgpack.Decoder:
    """Decodes what the API process receives."""
    return msgspec.msgpack.Decoder(FromEngine)
