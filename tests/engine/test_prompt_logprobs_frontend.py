"""The front end's assembly of prompt logprobs (OutputProcessor): a run resumed elsewhere sends a
prompt's logprobs again and the repeats are skipped; a gap fails the request rather than leave a hole."""

from __future__ import annotations

from tandem.core.step_io import SampledLogprobs
from tandem.engine.messages import EngineCoreRequest, SampleOutput
from tandem.engine.processor import OutputProcessor
from tandem.engine.tokenizer import Tokenizer
from tandem.sampling_params import SamplingParams

PROMPT = [10, 11, 12, 13, 14]


def lp(v: float) -> SampledLogprobs:
    return SampledLogprobs(logprob=v, rank=2, top_ids=[7], top_logprobs=[-0.5])


def processor(tokenizer_dir) -> OutputProcessor:
    proc = OutputProcessor(Tokenizer(str(tokenizer_dir)))
    params = SamplingParams(max_tokens=1, prompt_logprobs=1)
    proc.add(EngineCoreRequest("r", PROMPT, params, 1, 0.0), None)
    return proc


def chunk(start: int, values: list[float], token: int | None = None) -> SampleOutput:
    so = SampleOutput("r", 0, [] if token is None else [token], None, "length" if token is not None else None)
    so.prompt_logprobs, so.prompt_logprobs_start = [lp(v) for v in values], start
    return so


def test_repeats_are_skipped(tokenizer_dir):
    proc = processor(tokenizer_dir)
    proc.process([chunk(1, [-1.0, -2.0])])
    # A resumed run computes the prompt from the start again.
    outs, _, failed = proc.process([chunk(1, [-1.0, -2.0, -3.0, -4.0], token=5)])
    assert not failed
    (out,) = outs
    got = out.prompt_logprobs
    assert got[0] is None and len(got) == len(PROMPT)
    assert [e[t].logprob for e, t in zip(got[1:], PROMPT[1:])] == [-1.0, -2.0, -3.0, -4.0]
    assert got[1][7].rank == 1 and got[1][PROMPT[1]].rank == 2


def test_a_gap_fails_the_request(tokenizer_dir):
    proc = processor(tokenizer_dir)
    proc.process([chunk(1, [-1.0])])
    outs, _, failed = proc.process([chunk(3, [-3.0, -4.0], token=5)])
    assert failed == ["r"]
    assert outs[0].error is not None and "prompt logprobs" in outs[0].error


def test_finishing_short_of_the_prompt_fails_the_request(tokenizer_dir):
    proc = processor(tokenizer_dir)
    outs, _, failed = proc.process([chunk(1, [-1.0, -2.0], token=5)])
    assert failed == ["r"] and "3 of 5 prompt logprobs" in (outs[0].error or "")
