"""A token's work does not grow with the request's length (issue 42, point 8), checked by counting
what is touched, never by timing:

- the engine reads a request's token list only where it is new (penalty counts, bad words,
  batches): elements read per step stay bounded while the output grows;
- the runner's per-request penalty state, updated with new tokens only, equals a rebuild from the
  whole output at every step, through preemption, forks, speculative decoding, seeds;
- the front end's delta outputs (RequestOutputKind.DELTA) hold only what is new, join to exactly
  the cumulative outputs (stop strings, hold-back, n > 1, logprobs, prompt logprobs), and a
  delivery allocates as much late in a long request as early on;
- the API process's side (`OutputSoFar`, `coalesce`, the tool-call reader) works on deltas: the
  reader keeps a bounded window of text.
"""

from __future__ import annotations

import tracemalloc
from typing import Any

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.core.request import Request
from tandem.core.step_io import SampledLogprobs
from tandem.engine.core_client import RequestStream
from tandem.engine.messages import EngineCoreRequest, SampleOutput
from tandem.engine.processor import OutputProcessor
from tandem.engine.tokenizer import Tokenizer
from tandem.entrypoints.openai.serving import OutputSoFar
from tandem.entrypoints.openai.tool_parsers import get_tool_parser
from tandem.outputs import CompletionOutput, RequestOutput, coalesce
from tandem.sampling_params import RequestOutputKind
from tandem.worker.sampler import PenaltyState

VOCAB = 64


class CountingList(list):
    """A list that counts the elements read out of it (indexing, slicing, iterating)."""

    def __init__(self, items: list[int], counter: list[int]) -> None:
        super().__init__(items)
        self.counter = counter

    def __getitem__(self, key: Any) -> Any:
        got = super().__getitem__(key)
        self.counter[0] += len(got) if isinstance(key, slice) else 1
        return got

    def __iter__(self) -> Any:
        self.counter[0] += len(self)
        return super().__iter__()


def rebuilt(req: Request, history: list[int], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The penalty inputs of one row computed from scratch, as the runner did before."""
    counts = torch.zeros(vocab, dtype=torch.int32)
    out = req.output_token_ids + history
    if out:
        ids = torch.tensor(out)
        counts.index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
    mask = torch.zeros(vocab, dtype=torch.bool)
    mask[torch.tensor(req.prompt_token_ids)] = True
    return counts, mask


def penalized_request(rid: str, prompt: list[int], output: list[int]) -> Request:
    sp = SamplingParams(max_tokens=4096, repetition_penalty=1.2)
    return Request(rid, prompt, sp, 4096, token_ids=[*prompt, *output])


# -- the runner's penalty state ------------------------------------------------------------------


def test_penalty_state_counts_each_new_token_once_and_reads_nothing_else():
    state = PenaltyState(VOCAB, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, VOCAB, (50,), generator=gen).tolist()
    req = penalized_request("a", prompt, [])
    reads = [0]
    req.token_ids = CountingList(req.token_ids, reads)
    for step in range(300):
        new = torch.randint(0, VOCAB, (1 + step % 3,), generator=gen).tolist()  # accepted drafts too
        req.token_ids.extend(new)
        history = torch.randint(0, VOCAB, (step % 4,), generator=gen).tolist()
        before = reads[0]
        counts, mask = state.rows([(req, history), (req, [])], [True, True])
        # The new tokens are read once; neither the prompt nor older outputs are read again.
        assert reads[0] - before == len(new)
        want_counts, want_mask = rebuilt(req, history, VOCAB)
        assert torch.equal(counts[0], want_counts) and torch.equal(mask[0], want_mask)
        assert torch.equal(counts[1], rebuilt(req, [], VOCAB)[0])


def test_penalty_state_recounts_a_new_request_object_or_a_shorter_output():
    state = PenaltyState(VOCAB, torch.device("cpu"))
    first = penalized_request("a", [1, 2, 3], [4, 4, 5])
    state.rows([(first, [])], [True])
    # The same id, another object (a request moved away and back, resumed elsewhere and back).
    again = penalized_request("a", [7, 8], [9])
    counts, mask = state.rows([(again, [])], [True])
    assert torch.equal(counts[0], rebuilt(again, [], VOCAB)[0]) and torch.equal(
        mask[0], rebuilt(again, [], VOCAB)[1]
    )
    # Fewer outputs than counted: counted afresh rather than trusted.
    del again.token_ids[-1]
    counts, _ = state.rows([(again, [])], [True])
    assert torch.equal(counts[0], rebuilt(again, [], VOCAB)[0])
    # Rows without penalties get nothing (and make no entry); forgetting drops the entry.
    plain = Request("p", [1], SamplingParams(), 8, token_ids=[1, 2])
    counts, mask = state.rows([(plain, [3])], [False])
    assert not counts.any() and not mask.any() and "p" not in state.entries
    state.forget(["a"])
    assert state.entries == {}


def checked_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make every PenaltyState.rows call also rebuild its rows from scratch and compare."""
    original = PenaltyState.rows
    calls = [0]

    def rows(self: PenaltyState, members: list[tuple[Request, list[int]]], penalized: list[bool]):
        counts, mask = original(self, members, penalized)
        for i, ((req, history), on) in enumerate(zip(members, penalized)):
            if on:
                want_counts, want_mask = rebuilt(req, history, self.vocab_size)
                assert torch.equal(counts[i], want_counts), req.request_id
                assert torch.equal(mask[i], want_mask), req.request_id
        calls[0] += 1
        return counts, mask

    monkeypatch.setattr(PenaltyState, "rows", rows)
    return calls


ENGINE = dict(
    block_size=4,
    max_num_batched_tokens=24,  # chunked prefill
    num_kv_blocks=30,  # preemption
    max_num_seqs=8,
    max_model_len=80,
    enable_prefix_caching=True,
    num_threads=1,
)


@pytest.mark.parametrize("spec", [None, "ngram", "draft_model"])
def test_penalty_state_equals_a_rebuild_at_every_step(spec, model_factory, monkeypatch):
    """Through preemption, chunked prefill, prefix hits, forks (n=2), seeds, min_tokens and
    speculative decoding (draft rows count their drafts), the incremental counts are the rebuilt
    ones at every step; an entry goes when its request ends."""
    target = model_factory("llama", initializer_range=0.05)
    config: dict[str, Any] | None = None
    if spec == "ngram":
        config = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}
    elif spec == "draft_model":
        draft = model_factory("llama", seed=1, num_hidden_layers=1, initializer_range=0.05)
        config = {
            "method": "draft_model",
            "model": str(draft),
            "num_speculative_tokens": 2,
            "adaptive": False,
        }
    calls = checked_rows(monkeypatch)
    llm = LLM(str(target), speculative_config=config, **ENGINE)
    stem = list(range(10, 22))
    prompts = [{"prompt_token_ids": stem[: 4 + i] + [30 + i, 31 + i, 32 + i] * 3} for i in range(8)]
    params = []
    for i in range(8):
        kw: dict[str, Any] = dict(
            max_tokens=24, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.2
        )
        if i % 2:
            kw.update(temperature=0.8, seed=100 + i, presence_penalty=0.5)
        else:
            kw.update(temperature=0.0)
        if i == 1:
            kw.update(n=2)
        if i == 2:
            kw.update(min_tokens=5, logprobs=2)
        params.append(SamplingParams(**kw))
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(c.token_ids) == 24 for o in outs for c in o.outputs)
    assert llm.engine.counters.num_preemptions > 0 and calls[0] > 0
    llm.engine.step()  # the runner hears of the last finished requests with the next step
    assert llm.engine.core.runner.penalty_state.entries == {}


# -- the engine: elements read per step ----------------------------------------------------------


def test_engine_reads_a_growing_request_only_where_it_is_new(llama_dir):
    """Penalties, bad words, min_tokens, logprobs and a stop string, 600 tokens: the elements read
    from the request's token list per step stay bounded (before, penalties and bad words copied
    the whole output every step: 600 a step by the end)."""
    llm = LLM(str(llama_dir), num_threads=1, max_model_len=1024, block_size=16)
    engine = llm.engine
    params = SamplingParams(
        max_tokens=600,
        ignore_eos=True,
        temperature=0.0,
        repetition_penalty=1.1,
        frequency_penalty=0.1,
        bad_words=["zzz qqq xyzzy"],
        min_tokens=2,
        logprobs=1,
        stop=["\x00never\x00"],
        output_kind=RequestOutputKind.DELTA,
    )
    engine.add_request("r", {"prompt_token_ids": list(range(5, 45))}, params)
    reads = [0]
    for req in list(engine.scheduler.requests.values()):
        req.token_ids = CountingList(req.token_ids, reads)
    per_step, sizes = [], []
    while engine.has_unfinished_requests():
        before = reads[0]
        for out in engine.step():
            sizes.append(len(out.outputs[0].token_ids))
        per_step.append(reads[0] - before)
    assert len(per_step) >= 600 and sum(sizes) == 600
    assert max(sizes) == 1  # every delta holds its one new token
    # A step reads its new token a few times and, when a block fills, that block (prefix cache).
    assert max(per_step[5:]) <= 2 * 16 + 8, max(per_step[5:])


# -- the front end: deltas -----------------------------------------------------------------------


def run_both(llm: LLM, prompt: Any, params: SamplingParams) -> tuple[RequestOutput, list[RequestOutput]]:
    """The same seeded request as cumulative outputs (the last) and as delta outputs (all)."""
    engine = llm.engine
    finals: dict[RequestOutputKind, list[RequestOutput]] = {}
    for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA):
        rid = f"r-{kind.name}"
        engine.add_request(rid, prompt, params.clone(output_kind=kind))
        got = []
        while engine.has_unfinished_requests():
            got += [o for o in engine.step() if o.request_id == rid]
        finals[kind] = got
    return finals[RequestOutputKind.CUMULATIVE][-1], finals[RequestOutputKind.DELTA]


def joined(deltas: list[RequestOutput]) -> RequestOutput:
    assert all(d.delta for d in deltas)
    return coalesce(deltas)


@pytest.mark.parametrize(
    "kw",
    [
        dict(stop=["e", "th"], min_tokens=3),
        dict(stop=["e", "th"], include_stop_str_in_output=True),
        dict(stop=["a long stop string that never comes"], n=3, logprobs=2, temperature=1.0, seed=5),
        dict(prompt_logprobs=2, logprobs=1, n=2, temperature=0.7, seed=1),
        dict(detokenize=False, n=2, temperature=1.0, seed=3),
    ],
)
def test_deltas_join_to_the_cumulative_output(llama_dir, kw):
    # Prompt logprobs arrive in chunks; no prefix cache, so both runs compute the same way.
    llm = LLM(str(llama_dir), num_threads=1, max_num_batched_tokens=16, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=40, ignore_eos=True, **{"temperature": 0.0, **kw})
    cumulative, deltas = run_both(llm, "def f(x):\n    return x + 1\n", params)
    whole = joined(deltas)
    assert whole.finished and whole.delta
    for a, b in zip(whole.outputs, cumulative.outputs, strict=True):
        assert (a.index, a.text, a.token_ids, a.finish_reason, a.stop_reason) == (
            b.index,
            b.text,
            b.token_ids,
            b.finish_reason,
            b.stop_reason,
        )
        assert a.logprobs == b.logprobs and a.cumulative_logprob == b.cumulative_logprob
    assert whole.prompt_logprobs == cumulative.prompt_logprobs
    # Prompt logprobs come once, whole; no delta repeats a token.
    assert sum(d.prompt_logprobs is not None for d in deltas) == (kw.get("prompt_logprobs") is not None)
    assert whole.num_generation_tokens == sum(len(c.token_ids) for c in cumulative.outputs)
    if kw.get("stop") == ["e", "th"]:  # the stop strings are hit (and the text cut there)
        assert all(c.stop_reason in kw["stop"] for c in whole.outputs)


def test_final_only_emits_one_cumulative_output(llama_dir):
    llm = LLM(str(llama_dir), num_threads=1)
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)
    cumulative, _ = run_both(llm, "hello", params)
    llm.engine.add_request("f", "hello", params.clone(output_kind=RequestOutputKind.FINAL_ONLY))
    got = []
    while llm.engine.has_unfinished_requests():
        got += llm.engine.step()
    assert len(got) == 1 and got[0].finished and not got[0].delta
    assert got[0].outputs[0].token_ids == cumulative.outputs[0].token_ids
    assert got[0].outputs[0].text == cumulative.outputs[0].text


def feed_one_by_one(proc: OutputProcessor, rid: str, tokens: list[int], consume: Any = None) -> list[int]:
    """Deliver `tokens` one step each (each output then handed to `consume`); returns the bytes
    each delivery allocated at its peak."""
    peaks = []
    tracemalloc.start()
    try:
        for k, tok in enumerate(tokens):
            lp = [SampledLogprobs(-1.0, 1, [tok], [-1.0])]
            last = k == len(tokens) - 1
            update = SampleOutput(rid, 0, [tok], lp, finish_reason="length" if last else None)
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            outs, _, _ = proc.process([update])
            assert len(outs) == 1
            if consume is not None:
                consume(outs[0])
            peaks.append(tracemalloc.get_traced_memory()[1] - base)
    finally:
        tracemalloc.stop()
    return peaks


def test_a_delta_delivery_allocates_the_same_late_as_early(tokenizer_dir):
    """4000 tokens one at a time, with logprobs and a stop string (hold-back): a delivery's peak
    allocation at the end is no larger than at the start. Copying the token ids, logprobs or text
    so far (a cumulative output, or text grown by `+=` on an attribute) would add tens of KB."""
    tok = Tokenizer(str(tokenizer_dir))
    proc = OutputProcessor(tok)
    text = "def f(x):\n    return x + 1\n" * 200
    ids = (tok.encode(text, add_special_tokens=False) * 4)[:4000]
    params = SamplingParams(
        max_tokens=4000, logprobs=1, stop=["never ever"], output_kind=RequestOutputKind.DELTA
    )
    proc.add(EngineCoreRequest("r", [1, 2, 3], params, 4000, 0.0), None)
    peaks = feed_one_by_one(proc, "r", ids)
    early = max(peaks[50:250])
    late = max(peaks[-250:-1])
    assert late <= early + 512, (early, late)

    # The same through cumulative outputs does grow: the measurement can tell.
    proc.add(
        EngineCoreRequest("c", [1, 2, 3], params.clone(output_kind=RequestOutputKind.CUMULATIVE), 4000, 0.0),
        None,
    )
    peaks = feed_one_by_one(proc, "c", ids)
    assert max(peaks[-250:-1]) > max(peaks[50:250]) + 16 * 1024


def test_the_api_process_path_allocates_the_same_late_as_early(tokenizer_dir):
    """A streamed completion's parameters as the server makes them, through the output processor,
    the request's stream and the handler's `OutputSoFar`: a delivery late in a long request costs
    no more than early on (the server asking for cumulative outputs again would fail this)."""
    import asyncio

    from tandem.entrypoints.openai.protocol import CompletionRequest
    from tandem.entrypoints.openai.serving import sampling_params

    body = CompletionRequest(model="m", prompt="x", stream=True, logprobs=1, stop=["never ever"])
    params = sampling_params(body, 4000, 1)
    tok = Tokenizer(str(tokenizer_dir))
    proc = OutputProcessor(tok)
    proc.add(EngineCoreRequest("r", [1, 2, 3], params, 4000, 0.0), None)
    stream, so_far = RequestStream("r", asyncio.Event()), OutputSoFar()
    sent: list[int] = []

    def consume(out: RequestOutput) -> None:
        stream.put(out)
        taken = stream.take()
        assert taken is not None
        sent.append(len(so_far.add(taken).outputs[0].token_ids))

    ids = (tok.encode("def f(x):\n    return x + 1\n" * 200, add_special_tokens=False) * 4)[:4000]
    peaks = feed_one_by_one(proc, "r", ids, consume)
    assert sent == [1] * len(ids)  # each delivery hands on its one new token
    assert max(peaks[-250:-1]) <= max(peaks[50:250]) + 512
    whole = so_far.whole()
    assert whole.outputs[0].token_ids == ids and so_far.num_tokens == len(ids)
    assert whole.outputs[0].text == tok.decode(ids)


# -- the API process: turning outputs into deltas -------------------------------------------------


def output(texts: list[str], ids: list[list[int]], delta: bool, finished: bool = False) -> RequestOutput:
    samples = [
        CompletionOutput(i, t, list(x), finish_reason="stop" if finished else None)
        for i, (t, x) in enumerate(zip(texts, ids))
    ]
    return RequestOutput("r", None, [1], samples, finished=finished, delta=delta)


def test_output_so_far_turns_either_kind_into_deltas_and_keeps_the_whole():
    cumulative, deltas = OutputSoFar(), OutputSoFar()
    steps = [
        (["ab", "x"], [[1], [7]]),
        (["abcd", "x"], [[1, 2], [7]]),
        (["abcdef", "xyz"], [[1, 2, 3], [7, 8]]),
    ]
    prev_t, prev_i = ["", ""], [[], []]
    for k, (texts, ids) in enumerate(steps):
        last = k == len(steps) - 1
        a = cumulative.add(output(texts, ids, delta=False, finished=last))
        new_t = [t[len(p) :] for t, p in zip(texts, prev_t)]
        new_i = [x[len(p) :] for x, p in zip(ids, prev_i)]
        b = deltas.add(output(new_t, new_i, delta=True, finished=last))
        for got in (a, b):
            assert got.delta
            assert [c.text for c in got.outputs] == new_t
            assert [c.token_ids for c in got.outputs] == new_i
        prev_t, prev_i = texts, ids
    for so_far in (cumulative, deltas):
        whole = so_far.whole()
        assert not whole.delta and whole.finished
        assert [c.text for c in whole.outputs] == ["abcdef", "xyz"]
        assert [c.token_ids for c in whole.outputs] == [[1, 2, 3], [7, 8]]
        assert so_far.num_tokens == 5


def test_a_stream_joins_unread_deltas_and_keeps_only_the_newest_cumulative():
    import asyncio

    stream = RequestStream("r", asyncio.Event())
    stream.put(output(["a"], [[1]], delta=True))
    stream.put(output(["bc"], [[2, 3]], delta=True))
    got = stream.take()
    assert (
        got is not None
        and got.delta
        and got.outputs[0].text == "abc"
        and got.outputs[0].token_ids == [1, 2, 3]
    )
    assert stream.take() is None
    stream.put(output(["d"], [[4]], delta=False))
    stream.put(output(["de"], [[4, 5]], delta=False))
    got = stream.take()
    assert got is not None and not got.delta and got.outputs[0].text == "de"


def test_the_tool_call_reader_keeps_a_bounded_window():
    """Content streamed piece by piece is let go once sent; a call's arguments once sent. The
    deltas are those of the whole-text parse."""
    parser = get_tool_parser("hermes")
    reader = parser.reader()
    content = "word " * 2000
    call = '<tool_call>\n{"name": "f", "arguments": {"a": "' + "x" * 3000 + '"}}\n</tool_call>'
    text = content + call
    got_content, args, widest = "", "", 0
    for i in range(0, len(text), 3):
        d = reader.append(text[i : i + 3])
        got_content += d.content
        args += "".join(c.arguments for c in d.calls)
        widest = max(widest, len(reader.text))
    d = reader.finish()
    got_content += d.content
    whole = parser.parse(text)
    assert got_content == whole.content
    assert args == whole.calls[0].arguments == reader.calls[0].arguments
    assert widest < 64, widest
