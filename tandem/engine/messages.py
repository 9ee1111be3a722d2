"""What crosses the process boundary between the API process and the engine-core process.

Every message is a msgspec struct, encoded as MessagePack and sent over a ZeroMQ PUSH/PULL pair.
The payloads are plain dataclasses defined here (`EngineCoreRequest` in, `SampleOutput` out) or in
`core` (`EngineLimits`): whoever sends or receives them imports data, never the engine.

API -> engine: Init (once), Add, Abort, StopSample, MigrateOut, MigrateCancel, Shutdown.
Engine -> API: Hello (once, process up), Ready (once, core built), Outputs (a step's deltas plus,
periodically, Stats), Rejected (an Add the core refused), Migrated (a MigrateOut's outcome),
TransferDropped (a destination gave an incoming transfer up), Failed (fatal error, then the process exits).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from tandem.core.limits import EngineLimits
from tandem.core.step_io import TokenLogprobs
from tandem.sampling_params import SamplingParams

# -- payloads ------------------------------------------------------------------


@dataclass(slots=True)
class EngineCoreRequest:
    """A tokenized, validated request (one user request; the core fans out its `n` samples)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    arrival_time: float
    priority: int = 0
    tenant: str | None = None
    cache_salt: str | None = None
    # A request resumed on this engine after another ran part of it: per sample index, the tokens
    # it has already produced (None for a sample that has finished). The engine recomputes their
    # KV and goes on from there; they count as output (max_tokens, penalties, min_tokens).
    resumed_outputs: list[list[int] | None] | None = None
    # Which of the front end's runs of this request this is (a request moved or resumed elsewhere
    # is sent again with the next number); echoed in its outputs, so the front end can tell a run
    # it has left behind from the one it follows, even on the same instance.
    incarnation: int = 0


@dataclass(slots=True)
class SampleOutput:
    """What one sample of one request gained in a step."""

    request_id: str
    index: int
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Filled when the sample finishes.
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # Set (with finish_reason "error") when the engine failed this request alone.
    error: str | None = None
    # The request's `incarnation`.
    incarnation: int = 0
    # Logprobs of prompt tokens computed this step (sample 0 only, with `prompt_logprobs` set): one
    # per token from the prompt's token `prompt_logprobs_start` on.
    prompt_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs_start: int = 0


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


class MigrateOut(msgspec.Struct, tag="migrate"):
    """Move this running request, KV and all, to the engine whose KV inbox is `peer`
    (tandem/kvtransfer/sender.py); `request` is as first sent, with the incarnation its run there gets."""

    request: EngineCoreRequest
    transfer_id: str
    peer: str
    # Prefill/decode hand-off: sent with the request's Add; the request need not run yet. Its blocks
    # go as its prefill computes them, and it is handed over once its first token is sampled.
    after_prefill: bool = False


class MigrateCancel(msgspec.Struct, tag="migrate_cancel"):
    """Give a migration up (its destination is gone); the request stays where it is."""

    request_id: str
    transfer_id: str


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
    """A snapshot of the core; counters are cumulative since start, `iteration_tokens` since the last one."""

    num_running: int
    num_waiting: int
    kv_usage: float
    num_preemptions: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    prompt_tokens: int
    generation_tokens: int
    iteration_tokens: list[int]
    # Speculative decoding (zero without it).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    # Requests the engine failed alone (a fault in their own part of a step).
    num_request_faults: int = 0
    # Steps run and the seconds they took (schedule, forward, sample, update): the engine's busy time.
    num_steps: int = 0
    step_seconds: float = 0.0
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


class Migrated(msgspec.Struct, tag="migrated"):
    """A MigrateOut's outcome, sent after the request's last outputs from this engine. With `ok` the
    destination runs the request now (its outputs carry the new incarnation); without, it stays here
    (`reason`: "not_running" when it was not running, so it has no KV worth moving)."""

    request_id: str
    transfer_id: str
    ok: bool
    reason: str = ""
    # Paused (stop-and-copy) until the destination confirmed, and what was sent.
    downtime_s: float = 0.0
    num_bytes: int = 0
    num_stages: int = 0
    # From MigrateOut to the destination's confirmation.
    transfer_s: float = 0.0
    # Without `ok`: the destination refused the transfer up front (no free sequence seat, no room
    # for its blocks, another KV format), so nothing was copied; not a transfer that failed.
    refused: bool = False


class TransferDropped(msgspec.Struct, tag="transfer_dropped"):
    """From a transfer's destination: its source went silent past the timeout, so the blocks
    reserved for it were freed (the source may be hung; the front end moves the request)."""

    request_id: str
    transfer_id: str
    reason: str


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
