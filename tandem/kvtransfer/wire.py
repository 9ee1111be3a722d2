"""What two engines say to each other about one transfer of a request's KV (msgpack headers).

Source -> destination: Begin (reserve seats and blocks), Blocks (a stage: full blocks, payload
attached), Handover (the request's state and its last blocks; the source has paused it), Cancel.
Destination -> source: Accepted (reserved, or why not), Installed (the request runs here now, or
why it could not). Blocks are named by their ids on the source; the destination maps them.
"""

from __future__ import annotations

import msgspec

from tandem.engine.messages import EngineCoreRequest


class SampleState(msgspec.Struct):
    """One sample of the request as the source leaves it."""

    output_token_ids: list[int]
    num_computed_tokens: int
    # Source block ids, in block-table order, covering its computed tokens.
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
    transfer_id: str
    block_ids: list[int]


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


WireMessage = Begin | Accepted | Blocks | Handover | Installed | Cancel


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(WireMessage)
