"""The migration protocol, in one place: the messages of a move, its states and its outcomes.

A move hands a request, KV and all, from a source engine to a destination engine: a live
migration (the request runs; its KV is copied in stages while it decodes, then it pauses for the
rest) or a prefill/decode hand-off (the same transfer, started with the request's Add and handed
over at its first token). Three parties speak:

    front end -> source:        MigrateOut (start), MigrateCancel (its destination is gone)
    source -> front end:        Migrated (the outcome, after the request's last outputs there)
    destination -> front end:   TransferDropped (it gave a silent source's transfer up)
    source -> destination:      Begin, Blocks (one message of a stage), Handover, Cancel
    destination -> source:      Accepted (reserved, or refused and why), Staged (a stage has
                                landed), Installed (it runs here now, or failed and why)

Blocks are named by their ids on the source; the destination maps them to its own.

The source's transfer goes through `TransferState`s; the engine loop calls the sender's
`after_step` after each engine step and `tick` on every pass (timeouts). "(h)": a hand-off.

    state          event                                          next          what is done
    -------------  ---------------------------------------------  ------------  ---------------------------------
    -              MigrateOut, the request running here           ACCEPTING     Begin
    -              MigrateOut after_prefill (h)                   COPYING       Begin (acceptance not awaited)
    -              MigrateOut, it waits or was preempted          -             Migrated(RECOMPUTED)
    -              MigrateOut, it is moving already (or, (h),     -             Migrated(ABORTED)
                   it is not here)
    ACCEPTING      Accepted                                       COPYING       -
    ACCEPTING      Accepted(refused)                              -             Migrated(REFUSED)
    COPYING        a step ran; more than migration_stop_blocks    STAGING       hold them; send the stage's
                   full blocks not sent yet, and fewer than                     first message
                   migration_max_stages stages so far
    COPYING        a step ran; otherwise                          HANDING_OVER  pause; send the rest + Handover
    STAGING        a step ran; messages of the stage left         STAGING       send the next (the last one
                                                                                asks for Staged)
    STAGING        Staged                                         COPYING       -
    COPYING (h)    a step ran; its first token sampled            HANDING_OVER  pause; send the queue, the rest
                                                                                + Handover
    COPYING (h)    a step ran; otherwise                          COPYING       hold and queue the new full
                                                                                blocks; send one message (or,
                                                                                now and then, a heartbeat)
    COPYING (h)    Accepted(refused)                              -             Migrated(REFUSED)
    HANDING_OVER   Installed                                      -             end it here; Migrated(COMPLETED)
    any            Installed(failed)                              -             unpause; Migrated(ABORTED)
    any            MigrateCancel; a send failed; the request      -             unpause; Cancel;
                   ended or was preempted; the answer awaited                   Migrated(ABORTED)
                   (Accepted, Staged, Installed) overdue

So a live migration's stages overlap decoding: a stage goes out after a step, the next decision
waits for the destination's Staged (at least one more step runs meanwhile) and sees the blocks
filled since, and the pause comes only once what is left is small (or the stages are used up),
with nothing of an earlier stage still on the wire ahead of the Handover. The engine loop spends
at most one message's gather per transfer and step on a stage (the transport sends it without
blocking), so copying a long context does not stall the request's own steps. A hand-off streams
its stages as the prefill computes them (its pause is set by the first token, not chosen).

The destination keeps an `Incoming` per transfer: reserved by Begin, written by each Blocks,
installed by Handover, freed on Cancel or when the source stays silent past the timeout (then
TransferDropped goes to the front end). A Cancel that arrives after the install aborts the
installed run.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol

import msgspec

from tandem.core.engine_io import EngineCoreRequest


class MoveLog(Protocol):
    """Where a plane notes each act of a move as it happens (an engine's step trace,
    tandem/engine/step_trace.py: what a replay of the run takes its moves from): `kind` is "begin",
    "stage", "pause", "end" on the source, "accept", "install" on the destination; `at` the plane's
    clock."""

    def __call__(self, kind: str, request_id: str, at: float, **fields: Any) -> None: ...


class TransferState(Enum):
    """Where a transfer stands at its source (the table above)."""

    ACCEPTING = "accepting"
    COPYING = "copying"
    STAGING = "staging"
    HANDING_OVER = "handing over"


class MoveOutcome(str, Enum):
    """How a move ended; the value is the `outcome` label of `tandem:migrations_total`."""

    # The destination runs the request now.
    COMPLETED = "completed"
    # The destination refused it up front (no free sequence seat, no room for its blocks, another
    # KV format): nothing was copied, the request stayed where it was.
    REFUSED = "refused"
    # The transfer failed after it began (the destination failed, died or went silent, the request
    # ended meanwhile): the request went on at its source.
    ABORTED = "aborted"
    # It had nothing computed worth copying (waiting or preempted): the front end moves it by
    # recompute instead.
    RECOMPUTED = "recomputed"
    # The destination gave the transfer up (its source went silent): the front end moves the
    # request there by recompute. Only the front end reports this one (from TransferDropped).
    DROPPED = "dropped"


# -- front end <-> engines ---------------------------------------------------------------------


class MigrateOut(msgspec.Struct, tag="migrate"):
    """Move this running request, KV and all, to the engine whose KV inbox is `peer`; `request` is as
    first sent, with the incarnation its run there gets."""

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


class Migrated(msgspec.Struct, tag="migrated"):
    """A MigrateOut's outcome, sent by the source after the request's last outputs from it. COMPLETED:
    the destination runs the request now (its outputs carry the new incarnation); otherwise it stays
    at the source. `reason` is for people (logs), never for branching."""

    request_id: str
    transfer_id: str
    outcome: MoveOutcome
    reason: str = ""
    # What was sent, and the stages copied while the request ran (the stop-and-copy not counted).
    num_bytes: int = 0
    num_stages: int = 0
    # From MigrateOut to the destination's confirmation, and the part of it the request was paused
    # here (the stop-and-copy, as the source sees it); the source's clock.
    transfer_s: float = 0.0
    pause_s: float = 0.0


class TransferDropped(msgspec.Struct, tag="transfer_dropped"):
    """From a transfer's destination: its source went silent past the timeout, so the blocks
    reserved for it were freed (the source may be hung; the front end moves the request)."""

    request_id: str
    transfer_id: str
    reason: str


@dataclass(slots=True)
class MoveReport:
    """What the front end reports of one move once it is over (metrics, benchmarks)."""

    request_id: str
    outcome: MoveOutcome
    handoff: bool = False
    num_bytes: int = 0
    num_stages: int = 0
    transfer_s: float = 0.0
    pause_s: float = 0.0
    # What the request lost, as its stream saw it: from its last output from the source to its
    # first from the destination (COMPLETED only; None when it ended before the destination's first).
    downtime_s: float | None = None
    reason: str = ""


# -- source <-> destination --------------------------------------------------------------------


class SampleState(msgspec.Struct):
    """One sample of the request as the source leaves it (what the destination installs)."""

    output_token_ids: list[int]
    num_computed_tokens: int
    # Block ids, in block-table order, covering its computed tokens (the source's on the wire; the
    # destination's own when it installs).
    block_ids: list[int]
    # Samples (by index) still to fork off this one once its first token is sampled.
    pending: list[int]
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    protected_until_outputs: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # The next prompt token owed a prompt logprob (Request.prompt_logprobs_next).
    prompt_logprobs_next: int = 1


class Begin(msgspec.Struct, tag="begin"):
    transfer_id: str
    reply_to: str
    # As the front end sent it, with the incarnation the destination's run of it gets.
    request: EngineCoreRequest
    num_seats: int
    num_blocks: int
    block_bytes: int
    # What the blocks hold (KVCacheFormat.name: "int8", "fp8_e4m3", or the model dtype under auto);
    # the destination refuses a transfer whose format is not its own.
    kv_cache_dtype: str


class Accepted(msgspec.Struct, tag="accepted"):
    transfer_id: str
    ok: bool
    reason: str = ""


class Blocks(msgspec.Struct, tag="blocks"):
    """One message of a stage (payload attached), or with no block a heartbeat. `ack`: the last
    message of a live migration's stage; the destination answers Staged once it is written."""

    transfer_id: str
    block_ids: list[int]
    ack: bool = False


class Staged(msgspec.Struct, tag="staged"):
    transfer_id: str


class Handover(msgspec.Struct, tag="handover"):
    transfer_id: str
    reply_to: str
    block_ids: list[int]
    # Per sample index; None for a sample that has finished.
    samples: list[SampleState | None]


class Installed(msgspec.Struct, tag="installed"):
    transfer_id: str
    ok: bool
    reason: str = ""


class Cancel(msgspec.Struct, tag="cancel"):
    transfer_id: str


PeerMessage = Begin | Accepted | Blocks | Staged | Handover | Installed | Cancel


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def decoder() -> msgspec.msgpack.Decoder:
    """Decodes what engines send each other."""
    return msgspec.msgpack.Decoder(PeerMessage)
