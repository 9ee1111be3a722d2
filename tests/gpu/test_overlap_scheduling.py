"""Overlap scheduling (`async_scheduling`, docs/gpu.md): step N+1 planned and launched before step
N's tokens are read back, run on a CPU through the GPU path's code (the `triton` backend, decode
batches through the static buffers CUDA graphs replay) and through the CPU path.

Outputs with it on equal the synchronous loop's and transformers' across max_tokens cuts, stop
tokens, stop strings, chunked prefill, prefix-cache hits, preemption, aborts, seeded n > 1
sampling and batches mixing requests that need the synchronous fallback; no KV block leaks and no
token is delivered past a stop. The mechanism itself is checked: schedule(N+1) runs before
collect(N) on plain decode steps, and a launched step reads nothing back to the host (its one read
is in collect).
"""

from __future__ import annotations

import os

import hf_reference
import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.config import EngineConfig
from tandem.core.overlap import FAULT, FORK, HOST_TOKENS, PREEMPTION, sync_reason
from tandem.core.request import PLACEHOLDER, Request
from tandem.core.step_io import SchedulerOutput
from tandem.engine.llm_engine import LLMEngine
from tandem.sampling_params import StructuredOutputsParams
from tandem.worker.device import resolve_device_plan

pytest.importorskip("triton")

DEVICE = os.environ.get("TANDEM_TEST_DEVICE", "cpu")
GPU_KV = {"kv_cache_memory": 64 << 20} if DEVICE == "cuda" else {}
MAX_TOKENS = 8
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], list(range(20, 60)), list(range(100, 133))]

ENGINES = {
    "graphs": dict(attention_backend="triton"),
    "chunked": dict(attention_backend="triton", block_size=4, max_num_batched_tokens=16),
    # Every prompt admitted at once, then short of blocks as they grow (every output runs to 8).
    "preempt": dict(attention_backend="triton", block_size=4, num_kv_blocks=24, max_num_batched_tokens=96),
    "swap": dict(
        attention_backend="triton",
        block_size=4,
        num_kv_blocks=24,
        max_num_batched_tokens=96,
        swap_space=0.01,
        preemption_mode="swap",
    ),
    "eager": dict(attention_backend="triton", enforce_eager=True),
    "cpu-path": dict(attention_backend="torch"),
}


def make(model_dir, overlap: bool, **kw) -> LLM:
    llm = LLM(str(model_dir), dtype="float32", device=DEVICE, async_scheduling=overlap, **{**GPU_KV, **kw})
    assert llm.engine.core.overlap is overlap
    return llm


def run(llm: LLM, prompts, params) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def check_no_leak(llm: LLM) -> None:
    core = llm.engine.core
    assert not core.has_unfinished_requests()
    core.kv.check_invariants()
    assert core.kv.num_available == core.num_blocks
    assert not core.scheduler.requests


@pytest.fixture(scope="module")
def model_dir(model_factory):
    return model_factory("llama")


@pytest.mark.parametrize("engine", list(ENGINES))
def test_greedy_equals_the_synchronous_loop_and_transformers(model_dir, engine):
    """Each prompt with its own max_tokens (cut at 1, 3, 8 and 5 tokens), with overlap on."""
    ref = hf_reference.hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    cuts = [MAX_TOKENS] * 4 if engine in ("preempt", "swap") else [1, 3, MAX_TOKENS, 5]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in cuts]
    llm = make(model_dir, True, **ENGINES[engine])
    got = run(llm, PROMPTS, params)
    assert got == [r[0][:m] for r, m in zip(ref, cuts)]
    assert run(make(model_dir, False, **ENGINES[engine]), PROMPTS, params) == got
    core = llm.engine.core
    assert core.overlap_steps > 0
    if engine in ("preempt", "swap"):
        assert core.counters.num_preemptions > 0 and core.overlap_sync_steps.get(PREEMPTION, 0) > 0
    if engine == "swap":
        assert core.counters.num_swap_outs > 0
    if engine == "graphs":
        assert core.runner.graphs is not None and core.runner.graphs.steps > 0
    check_no_leak(llm)


def test_stop_tokens_and_stop_strings_end_where_the_synchronous_loop_ends(model_dir, tokenizer_dir):
    """A stop token and a stop string taken from each prompt's greedy continuation: the output ends
    there, with overlap on as off, and nothing past the stop is delivered (the extra token the
    step in flight computed is dropped)."""
    ref = hf_reference.hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    stop_at = [2, 4, 1, 3]
    params = [
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[r[0][j]], detokenize=False)
        for r, j in zip(ref, stop_at)
    ]
    on, off = (
        make(model_dir, True, attention_backend="triton"),
        make(model_dir, False, attention_backend="triton"),
    )
    got = run(on, PROMPTS, params)
    assert got == run(off, PROMPTS, params)
    for tokens, r in zip(got, ref):
        first = r[0].index(tokens[-1])
        assert tokens == r[0][: first + 1]
    check_no_leak(on)

    # Stop strings are the front end's: found in the text, it ends the sample in the core.
    text_params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    full = on.generate([{"prompt_token_ids": p} for p in PROMPTS], text_params, use_tqdm=False)
    stops = [o.outputs[0].text[3:6] for o in full]
    outs = {}
    for name, llm in (("on", on), ("off", off)):
        res = llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS],
            [
                SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, stop=[s])
                for s in stops
            ],
            use_tqdm=False,
        )
        outs[name] = [(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in res]
    assert outs["on"] == outs["off"]
    for (text, _, reason), s in zip(outs["on"], stops):
        if s.strip():
            assert s not in text and reason == "stop"
    check_no_leak(on)


def test_prefix_cache_hits_and_n_samples_with_seeds(model_dir):
    shared = list(range(5, 69))
    prompts = [[*shared, 70, 71], [*shared, 72, 73, 74]]
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, n=3, seed=11, max_tokens=MAX_TOKENS, ignore_eos=True)
    results = {}
    for overlap in (True, False):
        llm = make(model_dir, overlap, attention_backend="triton", block_size=16)
        first = run(llm, prompts[:1], greedy)
        second = run(llm, prompts[1:], greedy)
        assert llm.get_stats()["prefix_cache_hits"] > 0
        samples = llm.generate([{"prompt_token_ids": p} for p in prompts], seeded, use_tqdm=False)
        results[overlap] = (first, second, [[s.token_ids for s in o.outputs] for o in samples])
        check_no_leak(llm)
    assert results[True] == results[False]
    ref = hf_reference.hf_greedy(model_dir, prompts, MAX_TOKENS)
    assert results[True][0] + results[True][1] == [r[0] for r in ref]


def test_a_mixed_batch_falls_back_per_step_and_matches(model_dir):
    """Plain requests beside ones that need their tokens on the host (logprobs, penalties,
    allowed_token_ids): those steps run synchronously, the rest overlap, the outputs are the
    synchronous loop's."""
    engines = {overlap: make(model_dir, overlap, attention_backend="triton") for overlap in (True, False)}
    eos = engines[True].engine.core.eos_token_ids[0]
    params = [
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, allowed_token_ids=[7, 8, 9, 10]),
    ]
    got = {}
    for overlap, llm in engines.items():
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        got[overlap] = [
            (o.outputs[0].token_ids, [lp and sorted(lp) for lp in (o.outputs[0].logprobs or [])])
            for o in outs
        ]
        check_no_leak(llm)
        if overlap:
            assert llm.engine.core.overlap_sync_steps.get(HOST_TOKENS, 0) > 0
    assert got[True] == got[False]

    # EOS pushed up by logit_bias and held back by min_tokens (neither needs the host): the request
    # ends at its 4th token, EOS, with the step in flight's extra token dropped; all of it overlapped.
    # Logprobs overlap too (read back with the tokens, after the same event).
    eos_params = [
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=3, logit_bias={eos: 30.0}),
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3),
    ]
    ends = {}
    for overlap, llm in engines.items():
        before = llm.engine.core.overlap_sync_steps.get(HOST_TOKENS, 0)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], eos_params, use_tqdm=False)
        ends[overlap] = [
            (o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].logprobs) for o in outs
        ]
        assert llm.engine.core.overlap_sync_steps.get(HOST_TOKENS, 0) == before
        check_no_leak(llm)
    # Tokens equal; logprobs equal up to float rounding: a step's batch differs by the requests that
    # stopped with a step in flight (a 2-row product rounds unlike a 1-row one).
    assert [e[:2] for e in ends[True]] == [e[:2] for e in ends[False]]
    for a, b in zip(ends[True][1][2] or [], ends[False][1][2] or []):
        assert a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 and a[t].rank == b[t].rank for t in a)
    assert len(ends[True][0][0]) == 4 and ends[True][0][0][-1] == eos and ends[True][0][1] == "stop"
    lps = ends[True][1][2]
    assert lps is not None and len(lps) == MAX_TOKENS and all(len(step) >= 3 for step in lps)
    assert engines[False].engine.core.overlap_steps == 0  # the synchronous engine launches nothing ahead
    assert engines[True].engine.core.overlap_steps > 0


def test_a_structured_output_request_beside_plain_ones(model_dir):
    pytest.importorskip("llguidance")
    choices = ["alpha", "beta gamma"]
    choice = StructuredOutputsParams(choice=choices)
    params = [
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=choice),
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
    ]
    got = {}
    for overlap in (True, False):
        llm = make(model_dir, overlap, attention_backend="triton")
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:3]], params, use_tqdm=False)
        got[overlap] = [(o.outputs[0].token_ids, o.outputs[0].text) for o in outs]
        check_no_leak(llm)
        if overlap:
            assert llm.engine.core.overlap_sync_steps.get(HOST_TOKENS, 0) > 0
    assert got[True] == got[False]
    assert got[True][1][1] in choices


def test_an_abort_mid_run_delivers_nothing_after_it_and_frees_every_block(model_dir):
    config = EngineConfig(
        model=str(model_dir),
        dtype="float32",
        device=DEVICE,
        attention_backend="triton",
        async_scheduling=True,
    )
    engine = LLMEngine(config)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, detokenize=False)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    seen: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
        if steps == 4:
            aborted_at = list(seen.get("r1", []))
            engine.abort_request("r1")
    assert seen["r1"] == aborted_at  # nothing after the abort, though a step for it was in flight
    assert all(len(seen[f"r{i}"]) == 12 for i in (0, 2, 3))
    core = engine.core
    assert core.overlap_steps > 0
    core.kv.check_invariants()
    assert core.kv.num_available == core.num_blocks


def instrument(core, monkeypatch) -> list[tuple[str, int]]:
    """Log the engine loop's calls in order, each launch and collect with the tensors it read back
    to the host (tolist, item, bool(), ...: each a device synchronisation on CUDA)."""
    events: list[tuple[str, int]] = []
    reads = {"n": 0}
    real_schedule, real_execute = core.scheduler.schedule, core.runner.execute
    real_launch, real_collect = core.runner.launch, core.runner.collect

    def schedule():
        sched = real_schedule()
        events.append(("schedule", len(sched.requests)))
        return sched

    def launch(sched, prev):
        before = reads["n"]
        handle = real_launch(sched, prev)
        events.append(("launch", reads["n"] - before))
        return handle

    def collect(handle):
        before = reads["n"]
        out = real_collect(handle)
        events.append(("collect", reads["n"] - before))
        return out

    def execute(sched):
        out = real_execute(sched)
        events.append(("execute", 0))
        return out

    def counting(real):
        def counted(self, *a, **k):
            reads["n"] += 1
            return real(self, *a, **k)

        return counted

    monkeypatch.setattr(core.scheduler, "schedule", schedule)
    monkeypatch.setattr(core.runner, "launch", launch)
    monkeypatch.setattr(core.runner, "collect", collect)
    monkeypatch.setattr(core.runner, "execute", execute)
    for name in ("tolist", "item", "__bool__", "__int__", "__float__", "numpy", "nonzero", "cpu"):
        monkeypatch.setattr(torch.Tensor, name, counting(getattr(torch.Tensor, name)))
    return events


def test_the_loop_plans_the_next_step_before_reading_the_last_back(model_dir, monkeypatch):
    """The mechanism: on plain decode steps schedule(N+1) comes before collect(N), and a launched
    step reads no tensor back to the host; collect reads once. With overlap off, every schedule
    follows the previous step's read."""
    params = SamplingParams(temperature=0.7, seed=5, max_tokens=10, ignore_eos=True, detokenize=False)
    for overlap in (True, False):
        llm = make(model_dir, overlap, attention_backend="triton")
        events = instrument(llm.engine.core, monkeypatch)
        run(llm, PROMPTS[:3], params)
        monkeypatch.undo()
        kinds = [e[0] for e in events]
        if not overlap:
            assert "launch" not in kinds and "collect" not in kinds
            continue
        launches = [e for e in events if e[0] == "launch"]
        collects = [e for e in events if e[0] == "collect"]
        assert len(launches) >= 8
        assert all(n == 0 for _, n in launches), launches  # nothing read back while launching
        assert all(n == 1 for _, n in collects), collects  # one read per collected step
        assert len(collects) == len(launches)
        # Between a step's launch and its collect come the next step's schedule and launch; only
        # the last step is collected after a schedule with nothing left to launch.
        ahead = [
            i
            for i, kind in enumerate(kinds)
            if kind == "collect" and kinds[i - 2 : i] == ["schedule", "launch"]
        ]
        assert len(ahead) == len(collects) - 1, kinds
        assert kinds[-3:] == ["schedule", "collect", "execute"], kinds


def test_decode_staging_is_double_buffered_and_placeholders_are_fed_on_the_device(model_dir):
    """Filling step N+1's inputs leaves step N's pinned staging as it was (its copies may still be
    queued on CUDA), and a fed row takes its token from the device tensor, not the host's
    placeholder."""
    graphs = make(model_dir, True, attention_backend="triton").engine.core.runner.graphs
    assert graphs is not None

    def decoding(tokens: list[int]) -> Request:
        r = Request("x", tokens, SamplingParams(), max_tokens=4)
        r.block_ids, r.num_computed_tokens = [0, 1], len(tokens) - 1
        return r

    graphs.fill([decoding([3, 4, 5])])
    graphs.fill(
        [decoding([6, 7, PLACEHOLDER])],
        (torch.tensor([0], device=graphs.device), torch.tensor([42], device=graphs.device)),
    )
    staged = sorted(int(st.ids_np[0]) for st in graphs.staging)
    assert staged == [PLACEHOLDER, 5]  # the first step's set untouched by the second fill
    assert int(graphs.ids[0]) == 42


def test_which_steps_fall_back_and_the_placeholders(model_dir):
    plain = Request("a", [1, 2, 3], SamplingParams(), max_tokens=4)
    assert sync_reason(SchedulerOutput(requests=[plain], num_tokens=[3])) is None
    fork = Request("b", [1, 2], SamplingParams(n=2), max_tokens=4)
    fork.pending_children = [Request("b-1", [1, 2], SamplingParams(), max_tokens=4)]
    assert sync_reason(SchedulerOutput(requests=[plain, fork], num_tokens=[3, 2])) == FORK
    lp = Request("c", [1, 2], SamplingParams(logprobs=1), max_tokens=4)
    assert sync_reason(SchedulerOutput(requests=[lp], num_tokens=[2])) is None  # copied beside the tokens
    pen = Request("d", [1, 2], SamplingParams(repetition_penalty=1.2), max_tokens=4)
    assert sync_reason(SchedulerOutput(requests=[plain, pen], num_tokens=[3, 2])) == HOST_TOKENS
    assert sync_reason(SchedulerOutput(requests=[plain], num_tokens=[3], preempted=[lp])) == PREEMPTION
    assert PLACEHOLDER < 0  # never a vocabulary id


def test_the_device_plan_turns_it_on_for_cuda_only_by_default(tmp_path):
    def plan(device: str, value: bool | None, cuda: bool):
        config = EngineConfig(model=str(tmp_path), device=device, async_scheduling=value)
        return resolve_device_plan(config, has_cuda=cuda).async_scheduling

    assert plan("cuda", None, True) is True
    assert plan("cpu", None, True) is False
    assert plan("auto", None, False) is False
    assert plan("cpu", True, False) is True
    assert plan("cuda", False, True) is False
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(model=str(tmp_path), async_scheduling="yes")  # type: ignore[arg-type]


@pytest.mark.gpu
def test_on_cuda_a_launched_step_never_waits_for_the_device(model_factory, monkeypatch):
    """On a GPU (on by default there): torch's sync debug mode raises inside every launch that
    would synchronise (a read back, a blocking copy from pageable memory), and the tokens equal
    the synchronous loop's, greedy and seeded."""
    model_dir = model_factory("llama")
    llm = LLM(str(model_dir), device="cuda", dtype="float32", kv_cache_memory=64 << 20)
    core = llm.engine.core
    assert core.overlap and core.runner.graphs is not None
    real = core.runner.launch

    def launch(sched, prev):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return real(sched, prev)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(core.runner, "launch", launch)
    params = [
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=3, max_tokens=16, ignore_eos=True),
    ]
    prompts = PROMPTS[:2] * 2
    got = run(llm, prompts, params * 2)
    assert core.overlap_steps >= 15 and core.runner.graphs.steps > 0
    sync = LLM(
        str(model_dir), device="cuda", dtype="float32", kv_cache_memory=64 << 20, async_scheduling=False
    )
    assert run(sync, prompts, params * 2) == got
    check_no_leak(llm)


def test_the_command_line_sets_it_either_way_or_leaves_it_to_the_device():
    from tandem.entrypoints.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["serve", "m"]).async_scheduling is None
    assert parse(["serve", "m", "--async-scheduling"]).async_scheduling is True
    assert parse(["serve", "m", "--no-async-scheduling"]).async_scheduling is False


def test_a_move_reading_a_request_collects_the_step_in_flight_first(model_dir):
    """The KV plane reads a request's samples (and pauses it) only with its tokens on the host: the
    step in flight is collected there, and its outputs go out with the next step's."""
    config = EngineConfig(
        model=str(model_dir),
        dtype="float32",
        device=DEVICE,
        attention_backend="triton",
        async_scheduling=True,
    )
    engine = LLMEngine(config)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, detokenize=False)
    engine.add_request("m", {"prompt_token_ids": PROMPTS[0]}, params)
    tokens: list[int] = []
    for _ in range(3):
        for out in engine.step():
            tokens = list(out.outputs[0].token_ids)
    core = engine.core
    assert core._in_flight is not None
    (sample,) = core.samples("m") or []
    assert sample is not None and PLACEHOLDER not in sample.token_ids and core._in_flight is None
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = list(out.outputs[0].token_ids)
    ref = hf_reference.hf_greedy(model_dir, PROMPTS[:1], MAX_TOKENS)
    assert tokens == ref[0][0][:6]


def test_a_fault_in_a_launch_fails_that_request_alone(model_dir):
    """A launch that raises is collected behind the step in flight and run again synchronously,
    where the failing request is found and failed alone; the others finish as without the fault."""
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            dtype="float32",
            device=DEVICE,
            attention_backend="triton",
            async_scheduling=True,
        )
    )
    runner = engine.core.runner
    original = runner.sampling_batch
    bad_prompt = [7, 7, 7, 7, 3]

    def sampling_batch(rows):
        if any(row.request.prompt_token_ids == bad_prompt for row in rows):
            raise RuntimeError("injected fault")
        return original(rows)

    runner.sampling_batch = sampling_batch  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)
    for i, p in enumerate(PROMPTS[:3]):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    done = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        steps += 1
        if steps == 3:  # mid-run, with a step in flight
            engine.add_request("bad", {"prompt_token_ids": bad_prompt}, params)
    assert done.pop("bad").outputs[0].finish_reason == "error"
    ref = hf_reference.hf_greedy(model_dir, PROMPTS[:3], MAX_TOKENS)
    assert [done[f"r{i}"].outputs[0].token_ids for i in range(3)] == [r[0] for r in ref]
    assert engine.core.overlap_sync_steps.get(FAULT, 0) >= 1
    engine.core.kv.check_invariants()
    assert engine.core.kv.num_available == engine.core.num_blocks


def test_the_steps_seconds_add_up_to_the_runs_time(model_dir):
    """A collected step is timed from the start of the call that collects it: the steps never
    overlap in time, so their seconds stay within the run's (timed from their own launches they
    would count each step twice, about double)."""
    import time

    llm = make(model_dir, True, attention_backend="triton")
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, detokenize=False)
    before = llm.get_stats()["engine_step_seconds"]
    t0 = time.perf_counter()
    run(llm, PROMPTS, params)
    wall = time.perf_counter() - t0
    seconds = llm.get_stats()["engine_step_seconds"] - before
    assert 0.5 * wall < seconds <= wall
