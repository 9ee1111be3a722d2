"""What `LLM.generate` and the engine return, shaped as vLLM's outputs."""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    # One dict per generated token: the sampled token and the top-k alternatives.
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort", "error" or None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    token_times: list[float] = field(default_factory=list)
    # Tokens generated so far, all samples together (a delta output's own token ids are only the
    # newest of them).
    num_generation_tokens: int = 0


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    # Why the request failed (its samples finish with reason "error"); None when it did not.
    error: str | None = None
    # With `SamplingParams.prompt_logprobs`: None for the first prompt token (nothing precedes it),
    # then per prompt token a dict holding it and the top-k alternatives (as vLLM's). A delta output
    # carries them once, whole (in the output where the last of them arrived, or the final one).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # Only what is new since the request's previous output (RequestOutputKind.DELTA): each sample's
    # new token ids, logprobs and text; finish_reason, stop_reason and cumulative_logprob as of now.
    delta: bool = False

    @property
    def num_generation_tokens(self) -> int:
        """Tokens generated so far over all samples, whichever kind of output this is."""
        if self.delta and self.metrics is not None:
            return self.metrics.num_generation_tokens
        return sum(len(c.token_ids) for c in self.outputs)


def coalesce(outputs: list[RequestOutput]) -> RequestOutput:
    """One output standing for `outputs`, a request's outputs in order: the last, unless it is a
    delta, when the deltas since the last cumulative output (if any) are joined into one, in time
    linear in what they hold (a reader that fell behind catches up in one piece)."""
    last = outputs[-1]
    first = len(outputs) - 1
    while first > 0 and outputs[first].delta:
        first -= 1
    if not last.delta or first == len(outputs) - 1:
        return last
    run = outputs[first:]
    samples = []
    for c in last.outputs:
        parts = [p for o in run for p in o.outputs if p.index == c.index]
        logprobs = None
        if any(p.logprobs is not None for p in parts):
            logprobs = [lp for p in parts for lp in p.logprobs or ()]
        samples.append(
            replace(
                c,
                text="".join(p.text for p in parts),
                token_ids=[t for p in parts for t in p.token_ids],
                logprobs=logprobs,
            )
        )
    prompt_logprobs = next((o.prompt_logprobs for o in run if o.prompt_logprobs is not None), None)
    return replace(last, outputs=samples, prompt_logprobs=prompt_logprobs, delta=outputs[first].delta)
