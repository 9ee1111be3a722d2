"""The simulator's step-time models (tandem/sim/cost.py) and the profiler that fits them
(tandem/sim/profile.py): files, the roofline's regimes, the fit, and `shape_of` on a real scheduler."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.request import Request
from tandem.core.scheduler import Scheduler
from tandem.core.step_io import RunnerOutput, SchedulerOutput
from tandem.core.step_shape import StepShape, shape_of
from tandem.sampling_params import SamplingParams
from tandem.sim.cost import (
    FEATURES,
    CostModel,
    FitError,
    FittedCost,
    FrontEndCpu,
    Hardware,
    ModelShape,
    RooflineCost,
    fit_coefficients,
    fit_cost,
    fit_transfer,
    load_cost,
    nnls,
    save_cost,
    select_features,
    shape_cell,
    shipped_cost_path,
    size_bin,
)

LLAMA3_8B = ModelShape(
    num_params=8_030_261_248,
    num_layers=32,
    hidden_size=4096,
    num_kv_heads=8,
    head_dim=128,
    dtype_bytes=2,
    vocab_size=128_256,
)
IDEAL_H200 = Hardware(
    peak_flops=989e12, memory_bandwidth=4.8e12, step_overhead_s=0.0, interconnect_bandwidth=50e9
)


def decode(rows: int, context: int) -> StepShape:
    """`rows` decode rows, each with `context` tokens of KV after the step."""
    return StepShape(0, rows, rows * context, rows, attention_tokens=rows * context)


def causal_pairs(query: int, context: int) -> int:
    """(query, key) pairs causal attention scores for `query` new tokens after `context` ones."""
    return query * context + query * (query + 1) // 2


def prefill(tokens: int, context: int = 0) -> StepShape:
    """One prompt chunk of `tokens` after `context` tokens already computed."""
    return StepShape(tokens, 0, context + tokens, 1, attention_tokens=causal_pairs(tokens, context))


def synthetic_shapes(n: int, seed: int = 0) -> list[StepShape]:
    """Decodes, prompt chunks and mixes of both, over the ranges a profile covers."""
    rng = random.Random(seed)
    shapes = []
    for i in range(n):
        rows = rng.randint(0, 64) if i % 3 else 0
        chunk = rng.choice([0, 0, 16, 64, 256, 1024, 2048]) if rows else rng.choice([16, 256, 1024, 2048])
        ctx = rng.randint(1, 2000)
        prior = rng.choice([0, 0, 512, 1024])
        shapes.append(
            StepShape(
                prefill_tokens=chunk,
                decode_rows=rows,
                context_tokens=rows * ctx + (chunk + prior if chunk else 0),
                num_requests=rows + (1 if chunk else 0),
                attention_tokens=rows * ctx + causal_pairs(chunk, prior),
            )
        )
    return shapes


# -- files -------------------------------------------------------------------------------------


def test_fitted_cost_round_trips_through_json(tmp_path: Path):
    model = FittedCost(
        "m",
        {"const": 1e-3, "tokens": 2e-5, "context_tokens": 3e-9},
        transfer_t0_s=1e-4,
        transfer_per_block_s=2e-6,
        fit_error=FitError(3.0, 6.0, 9.0, 30, 10),
        transfer_fit_error=FitError(1.0, 2.0, 3.0, 5, 5),
        delivery_s=0.012,
        ingress_s=0.002,
        loop_gap_s=3e-4,
        api_message_s=3e-4,
        api_token_s=8e-5,
        client_token_s=1.2e-4,
        corrections={(0, 10): 1.12, (17, 9): 0.9},
        meta={"note": "synthetic", "threads": 1},
    )
    path = tmp_path / "fitted.json"
    save_cost(model, path)
    assert json.loads(path.read_text())["kind"] == "fitted"
    loaded = load_cost(path)
    assert loaded == model
    shape = decode(8, 512)
    assert (
        loaded.step_seconds(shape)
        == model.step_seconds(shape)
        == pytest.approx(1e-3 + 8 * 2e-5 + 4096 * 3e-9)
    )
    assert loaded.transfer_seconds(10) == pytest.approx(1e-4 + 10 * 2e-6)
    assert loaded.transfer_seconds(0) == 0.0
    assert (loaded.delivery_seconds(), loaded.ingress_seconds(), loaded.loop_gap_seconds()) == (0.012, 0.002, 3e-4)
    assert isinstance(loaded, CostModel)
    assert loaded.front_end_cpu() == FrontEndCpu(3e-4, 8e-5, 0.0, 1.2e-4)
    # 32-47 decode rows and no prompt: the (0, 10) cell's factor on the linear seconds.
    assert loaded.step_seconds(decode(32, 100)) == pytest.approx(1.12 * (1e-3 + 32 * 2e-5 + 3200 * 3e-9))
    # A file written before the ingress, loop-gap, front-end times and corrections existed loads
    # with them at 0 (none).
    old = json.loads(path.read_text())
    del old["ingress_s"], old["loop_gap_s"], old["api_message_s"], old["api_token_s"], old["client_token_s"]
    del old["corrections"]
    path.write_text(json.dumps(old))
    older = load_cost(path)
    assert (older.ingress_seconds(), older.loop_gap_seconds(), older.delivery_seconds()) == (0.0, 0.0, 0.012)
    assert not older.front_end_cpu().measured
    assert older.step_seconds(decode(32, 100)) == pytest.approx(1e-3 + 32 * 2e-5 + 3200 * 3e-9)


def test_size_bins_are_half_octaves():
    bins = [size_bin(n) for n in range(0, 66)]
    assert bins[:8] == [0, 1, 2, 3, 4, 4, 5, 5]
    assert [size_bin(n) for n in (8, 11, 12, 15, 16, 23, 24, 31, 32, 47, 48, 63, 64)] == [
        6, 6, 7, 7, 8, 8, 9, 9, 10, 10, 11, 11, 12
    ]
    assert bins == sorted(bins)  # monotone: neighbouring sizes share a bin or the next one
    assert shape_cell(StepShape(400, 32, 9000, 34)) == (size_bin(400), size_bin(32)) == (17, 10)


def test_roofline_cost_round_trips_through_json(tmp_path: Path):
    model = RooflineCost(
        "r", LLAMA3_8B, IDEAL_H200, block_size=32, note="spec numbers", delivery_s=0.004, loop_gap_s=1e-4
    )
    path = tmp_path / "roofline.json"
    save_cost(model, path)
    loaded = load_cost(path)
    assert loaded == model
    assert isinstance(loaded, CostModel)
    assert loaded.step_seconds(prefill(512, 256)) == model.step_seconds(prefill(512, 256))


def test_load_rejects_what_is_not_a_cost_model(tmp_path: Path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"kind": "magic", "name": "x"}))
    with pytest.raises(ValueError, match="kind"):
        load_cost(path)
    path.write_text(json.dumps({"kind": "fitted", "name": "x", "coefficients": {"bogus": 1.0}}))
    with pytest.raises(ValueError, match="bogus"):
        load_cost(path)
    path.write_text(json.dumps({"kind": "roofline", "name": "x"}))
    with pytest.raises(ValueError, match="model"):
        load_cost(path)


# -- roofline ----------------------------------------------------------------------------------


def test_roofline_decode_grows_with_context():
    model = RooflineCost("r", LLAMA3_8B, IDEAL_H200)
    times = [model.step_seconds(decode(32, c)) for c in (128, 1024, 8192, 32768)]
    assert times == sorted(times) and len(set(times)) == len(times)
    # 32 rows x 32k context is 128 GiB... of KV reads at 128 KiB a token: far more than the weights.
    assert times[-1] > 5 * times[0]


def test_roofline_batch_is_memory_bound_then_compute_bound():
    model = RooflineCost("r", LLAMA3_8B, IDEAL_H200)
    small, large = decode(1, 16), prefill(8192)
    assert model.memory_seconds(small) > model.compute_seconds(small)
    assert model.compute_seconds(large) > model.memory_seconds(large)
    # Memory-bound: more rows ride on the same weight reads almost for free...
    assert model.step_seconds(decode(8, 16)) < 1.05 * model.step_seconds(decode(1, 16))
    # ...compute-bound: twice the tokens, about twice the time.
    assert model.step_seconds(prefill(8192)) / model.step_seconds(prefill(4096)) > 1.8
    # The ridge for Llama-3-8B on an H200 (989 TFLOP/s over 4.8 TB/s: ~206 FLOP per byte) lies at
    # a couple of hundred tokens a step.
    ridge = next(
        n
        for n in range(1, 2048)
        if model.compute_seconds(decode(n, 16)) > model.memory_seconds(decode(n, 16))
    )
    assert 150 < ridge < 300


def test_shipped_h200_model_gives_a_plausible_decode_step():
    model = load_cost(shipped_cost_path("h200-llama3-8b"))
    assert isinstance(model, RooflineCost)
    assert "not a measurement" in model.note
    one = model.step_seconds(decode(1, 1024))
    # 16 GB of bf16 weights at 4.8 TB/s is 3.3 ms, plus the step's overhead: a few ms.
    assert 0.003 < one < 0.008
    assert model.step_seconds(decode(64, 1024)) < 2 * one
    assert 0 < model.transfer_seconds(1) < model.transfer_seconds(100)


def test_shipped_measured_model_loads_with_its_fit_error():
    model = load_cost(shipped_cost_path("default-amd-epyc-fp32-1thread"))
    assert isinstance(model, FittedCost)
    assert model.fit_error is not None and model.fit_error.num_test > 0
    assert model.meta["measured_on"] in model.meta["note"]
    # The front end's share of a streamed token, timed through a real server: a few milliseconds.
    assert 0 < model.delivery_seconds() < 0.05
    # A decode step of the default model on one thread there took about 10-15 ms.
    assert 0.005 < model.step_seconds(decode(1, 256)) < 0.03
    assert (
        model.step_seconds(prefill(1024))
        > model.step_seconds(decode(64, 1024))
        > model.step_seconds(decode(1, 1024))
    )


# -- fitting -----------------------------------------------------------------------------------


def test_nnls_matches_scipy():
    scipy_optimize = pytest.importorskip("scipy.optimize")
    rng = np.random.default_rng(0)
    for _ in range(20):
        a = rng.normal(size=(40, 5))
        b = rng.normal(size=40)
        expected, _ = scipy_optimize.nnls(a, b)
        np.testing.assert_allclose(nnls(a, b), expected, atol=1e-9)


def test_fit_recovers_the_coefficients_of_synthetic_steps():
    truth = {"const": 2e-3, "tokens": 40e-6, "context_tokens": 1e-8, "extra_attention": 3e-9}
    generator = FittedCost("truth", truth)
    shapes = synthetic_shapes(120)
    seconds = [generator.step_seconds(s) for s in shapes]
    coef = fit_coefficients(shapes, seconds, list(truth))
    np.testing.assert_allclose(coef, list(truth.values()), rtol=1e-6)
    # Chosen from all the features, the fit finds the same costs (unneeded features add nothing).
    names = select_features(shapes, seconds)
    assert set(truth) <= set(names) <= set(FEATURES)
    fitted = fit_cost("fit", list(zip(shapes[:90], seconds[:90])), list(zip(shapes[90:], seconds[90:])))
    assert fitted.fit_error is not None and fitted.fit_error.mape < 1e-3
    for name, value in truth.items():
        assert fitted.coefficients[name] == pytest.approx(value, rel=1e-3)


def test_a_step_cost_past_the_tile_kernels_rows_is_found_and_matches_the_kernel():
    from tandem.model.linear import _AMX_MAX_ROWS
    from tandem.sim.cost import TILE_KERNEL_MAX_ROWS

    assert TILE_KERNEL_MAX_ROWS == _AMX_MAX_ROWS
    truth = {"const": 2e-3, "tokens": 40e-6, "context_tokens": 1e-8, "big_step": 1.5e-3}
    generator = FittedCost("truth", truth)
    shapes = synthetic_shapes(160, seed=2)
    assert any(s.tokens > TILE_KERNEL_MAX_ROWS for s in shapes) and any(s.tokens <= TILE_KERNEL_MAX_ROWS for s in shapes)
    seconds = [generator.step_seconds(s) for s in shapes]
    assert "big_step" in select_features(shapes, seconds)
    from tandem.sim.profile import describe

    assert "big_step" in describe(FittedCost("x", {n: 1e-3 for n in FEATURES}))  # every feature has a unit
    # Without that cost in the steps, the feature does not earn its place.
    plain = FittedCost("plain", {k: v for k, v in truth.items() if k != "big_step"})
    assert "big_step" not in select_features(shapes, [plain.step_seconds(s) for s in shapes])


def test_fit_with_noise_keeps_the_coefficients_close_and_reports_held_out_error():
    truth = {"const": 2e-3, "tokens": 40e-6, "context_tokens": 1e-8, "extra_attention": 3e-9}
    generator = FittedCost("truth", truth)
    rng = np.random.default_rng(1)
    shapes = synthetic_shapes(200, seed=1)
    seconds = [generator.step_seconds(s) * (1 + 0.03 * rng.standard_normal()) for s in shapes]
    fitted = fit_cost("fit", list(zip(shapes[:150], seconds[:150])), list(zip(shapes[150:], seconds[150:])))
    error = fitted.fit_error
    assert error is not None and (error.num_train, error.num_test) == (150, 50)
    # 3% noise: the held-out error is the noise's mean absolute value (2.4%), not more.
    assert 1.5 < error.mape < 4.0
    for name in ("const", "tokens", "context_tokens"):
        assert fitted.coefficients[name] == pytest.approx(truth[name], rel=0.1)


def test_fit_transfer_recovers_latency_and_per_block_cost():
    blocks = [1, 2, 4, 8, 16, 64, 256]
    t0, per_block, error = fit_transfer(blocks, [5e-4 + 2e-5 * n for n in blocks])
    assert (t0, per_block) == (pytest.approx(5e-4), pytest.approx(2e-5))
    assert error.mape < 1e-6


# -- shape_of on a real scheduler ----------------------------------------------------------------


def make_request(rid: str, prompt_len: int, max_tokens: int = 8) -> Request:
    return Request(
        rid, list(range(3, 3 + prompt_len)), SamplingParams(temperature=0.0), max_tokens=max_tokens
    )


def test_shape_of_a_scheduler_output():
    sched = Scheduler(KVCacheManager(64, 16), max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512)
    a, b = make_request("a", 10), make_request("b", 100)
    sched.add_request(a)
    sched.add_request(b)

    first = sched.schedule()
    assert first.num_tokens == [10, 54]
    # Two prompt chunks at context 0: a whole 10-token prompt and b's first 54 tokens.
    assert shape_of(first) == StepShape(
        prefill_tokens=64,
        decode_rows=0,
        context_tokens=64,
        num_requests=2,
        attention_tokens=causal_pairs(10, 0) + causal_pairs(54, 0),
    )
    sched.update(first, RunnerOutput(sampled={"a": 7}))

    second = sched.schedule()
    assert second.num_tokens == [1, 46]
    # a decodes one token after its 10; b's last 46 prompt tokens read its first 54.
    assert shape_of(second) == StepShape(
        prefill_tokens=46,
        decode_rows=1,
        context_tokens=11 + 100,
        num_requests=2,
        attention_tokens=11 + causal_pairs(46, 54),
    )
    sched.update(second, RunnerOutput(sampled={"a": 8, "b": 9}))

    third = sched.schedule()
    assert shape_of(third) == StepShape(0, 2, 12 + 101, 2, attention_tokens=12 + 101)
    # With drafts: a verifies 3 of them (a query of 4 tokens), still one decode row.
    spec = SchedulerOutput(requests=third.requests, num_tokens=[4, 1], num_draft={"a": 3})
    assert shape_of(spec) == StepShape(
        0, 2, 15 + 101, 2, draft_tokens=3, attention_tokens=causal_pairs(4, 11) + 101
    )
    assert shape_of(SchedulerOutput()) == StepShape(0, 0, 0, 0)


def test_bench_profile_is_a_cli_command():
    from tandem.entrypoints.cli import _bench_profile, build_parser

    args = build_parser().parse_args(["bench", "profile", "/some/model", "--out", "c.json", "--quick"])
    assert (args.model, args.out, args.threads, args.quick) == ("/some/model", "c.json", 1, True)
    assert args.func is _bench_profile


# -- the profiler on a real engine -----------------------------------------------------------------

# Held-out error bound of a quick profile of the tiny test model. Its steps take 1-30 ms, mostly
# Python and operator overhead, and on the shared 2-core development machines steps of one shape
# vary by 2-12% (median absolute deviation). Quick profiles there had a held-out mean error of
# 11-26% (a per-step constant alone: ~50%); the P90 rests on 8 held-out points and swings to 60-80%
# on a loaded machine, so it is not asserted. The bound leaves room for a machine busy with the
# rest of the suite and still fails a profiler that times the wrong steps or records the wrong
# shapes (errors of 100% and more).
QUICK_MAPE_BOUND = 60.0


@pytest.mark.slow
def test_quick_profile_of_the_tiny_model(llama_dir: Path, tmp_path: Path):
    from tandem.sim.profile import describe, profile_model

    out = tmp_path / "cost.json"
    # A profile timed while other tests load both cores can miss the bound by chance; a profiler
    # that times the wrong steps misses it every time.
    for _ in range(3):
        model = profile_model(str(llama_dir), str(out), quick=True)
        print(describe(model))
        loaded = load_cost(out)
        assert loaded == model
        assert isinstance(loaded, FittedCost) and loaded.fit_error is not None
        if loaded.fit_error.mape < QUICK_MAPE_BOUND:
            break
    assert loaded.fit_error.mape < QUICK_MAPE_BOUND, describe(loaded)
    assert loaded.coefficients["const"] > 0 and loaded.transfer_per_block_s > 0
    points = loaded.meta["points"]
    assert len(points["rows"]) == loaded.fit_error.num_train + loaded.fit_error.num_test
    # Bigger steps cost more: a 1024-token prompt against one decode row.
    assert loaded.step_seconds(prefill(1000)) > loaded.step_seconds(decode(1, 100))


def test_calibrate_fits_the_traced_steps_and_keeps_the_base_transfer_and_delivery(tmp_path):
    """A cost model fitted on a step trace recovers the per-step and per-token costs the trace
    was made with, and keeps what a trace cannot time from its base."""
    from tandem.engine.step_trace import StepTrace
    from tandem.sim.calibrate import calibrate

    path = tmp_path / "steps.jsonl"
    trace = StepTrace(path)
    start = 0.0
    for i in range(300):
        prefill = (i * 37) % 400 if i % 3 == 0 else 0
        rows = 1 + i % 12
        shape = StepShape(prefill, rows, 100 * rows + prefill, rows + (prefill > 0))
        seconds = 0.008 + 3e-4 * shape.tokens
        trace.record(start, seconds, shape, 0)
        # The loop's gap: 0.4 ms after most steps, 1 s of idleness (not a gap) after every 50th.
        start += seconds + (1.0 if i % 50 == 49 else 4e-4)
    trace.close()
    base = FittedCost(
        "base", {"const": 0.1}, transfer_t0_s=0.002, transfer_per_block_s=1e-4, delivery_s=0.004, ingress_s=0.001,
        api_message_s=3e-4, api_token_s=8e-5, client_message_s=1e-5, client_token_s=1.2e-4,
    )
    fitted = calibrate([path], base)
    assert fitted.coefficients["const"] == pytest.approx(0.008, rel=0.05)
    assert fitted.coefficients["tokens"] == pytest.approx(3e-4, rel=0.05)
    assert fitted.fit_error is not None and fitted.fit_error.mape < 2.0
    assert (fitted.transfer_t0_s, fitted.transfer_per_block_s, fitted.delivery_s) == (0.002, 1e-4, 0.004)
    assert fitted.ingress_s == 0.001
    assert fitted.front_end_cpu() == base.front_end_cpu()
    assert fitted.loop_gap_s == pytest.approx(4e-4, abs=1e-5)
    assert fitted.meta["source"] == "step trace"
    few = tmp_path / "few.jsonl"
    short = StepTrace(few)
    short.record(0.0, 0.01, StepShape(0, 1, 10, 1), 0)
    short.close()
    with pytest.raises(ValueError, match="too short"):
        calibrate([few], base)


def test_calibrate_corrects_the_shapes_a_linear_model_misses(tmp_path):
    """Steps whose cost is convex in the decode rows (as full batches are on a CPU): the linear fit
    leaves full batches and single rows tens of percent off; the cell corrections bring every cell
    with enough steps within a few percent, on held-out steps too, and a cell of a few steps moves
    only part of the way."""
    from tandem.engine.step_trace import StepTrace
    from tandem.sim.calibrate import calibrate

    def seconds(shape: StepShape) -> float:
        return 0.002 + 5e-5 * shape.prefill_tokens + 1e-4 * shape.decode_rows + 3e-6 * shape.decode_rows**2

    path = tmp_path / "steps.jsonl"
    trace = StepTrace(path)
    rng = random.Random(0)
    start = 0.0
    shapes = [decode(rng.choice([1, 2, 4, 8, 16, 24, 32, 32, 32]), 200) for _ in range(1500)]
    shapes += [StepShape(rng.randrange(32, 512), 4, 2000, 5) for _ in range(300)]
    shapes += [decode(64, 200)] * 3  # a rare shape: 3 steps of their own cell
    for shape in shapes:
        trace.record(start, seconds(shape), shape, 0)
        start += seconds(shape) + 4e-4
    trace.close()
    fitted = calibrate([path], FittedCost("base", {"const": 0.1}))
    linear = FittedCost("linear", fitted.coefficients)
    rows = [1, 2, 4, 8, 16, 24, 32]
    assert max(abs(linear.step_seconds(decode(r, 200)) / seconds(decode(r, 200)) - 1) for r in rows) > 0.08
    for r in rows:
        assert fitted.step_seconds(decode(r, 200)) == pytest.approx(seconds(decode(r, 200)), rel=0.02)
    rare = decode(64, 200)
    assert abs(linear.step_seconds(rare) - seconds(rare)) > abs(fitted.step_seconds(rare) - seconds(rare)) > 0.02 * seconds(rare)
    assert fitted.fit_error is not None and fitted.fit_error.mape < 3.0
    assert fitted.meta["corrected_cells"] == len(fitted.corrections) > 0
    save_cost(fitted, tmp_path / "fitted.json")
    assert load_cost(tmp_path / "fitted.json").step_seconds(rare) == fitted.step_seconds(rare)


def test_front_end_cpu_splits_into_per_message_and_per_token():
    from tandem.sim.profile import split_front_end_cpu

    def load(messages: int, tokens: int) -> tuple[int, int, float]:
        return messages, tokens, 3e-4 * messages + 2e-4 * tokens

    assert split_front_end_cpu(load(1000, 1100), load(500, 8000)) == pytest.approx((3e-4, 2e-4))
    # Loads that cannot tell the parts apart (same tokens per message) put it all per token.
    assert split_front_end_cpu(load(100, 200), load(200, 400)) == pytest.approx((0.0, (0.07 + 0.14) / 600))
    # A split with a negative part (timer noise) falls back the same way; nothing measured gives 0.
    assert split_front_end_cpu((1000, 1100, 0.1), (500, 8000, 1.6))[0] == 0.0
    assert split_front_end_cpu((0, 0, 0.0), (0, 0, 0.0)) == (0.0, 0.0)


def test_front_end_times_through_a_real_server():
    """`time_front_end` serves the default model and replays a few requests with the benchmark's
    client: the client sees more than the server's own time to first token, a request takes some
    time to reach the engine, and the engine loop spends some time between busy steps; all of it
    milliseconds, not seconds."""
    from tandem.entrypoints.llm import default_model_path
    from tandem.sim.profile import time_front_end

    got = time_front_end(default_model_path(), requests=6, rate=6.0)
    assert got["client_ttft_s"] > got["server_ttft_s"] > 0
    assert got["delivery_s"] == pytest.approx(got["client_ttft_s"] - got["server_ttft_s"])
    for key in ("delivery_s", "ingress_s", "loop_gap_s"):
        assert 0 < got[key] < 0.5, (key, got)
    assert got["loop_gaps"] > 0
    # The front end's CPU at the two loads (coarse at six requests: clock ticks of 10 ms).
    for process in ("api", "client"):
        assert 0 < got[f"{process}_message_s"] + got[f"{process}_token_s"] < 0.01, got
        messages, tokens, cpu_s = got[f"busy_{process}_messages_tokens_cpu_s"]
        assert messages > 0 and tokens > 0 and cpu_s > 0
