"""The engine's per-step trace (`step_trace`): one line per step whose planned shapes add up to the
work the requests did."""

from __future__ import annotations

import pytest

from tandem import LLM, SamplingParams
from tandem.engine.step_trace import read_step_trace


def test_step_trace_records_every_step_and_its_shape(model_factory, tmp_path):
    path = tmp_path / "steps.jsonl"
    llm = LLM(str(model_factory("llama")), num_kv_blocks=64, max_num_batched_tokens=32, step_trace=str(path))
    # Disjoint prompts: no prefix-cache hits, so every prompt token is computed.
    prompts = [{"prompt_token_ids": list(range(s, s + n))} for s, n in ((5, 40), (100, 7), (200, 19))]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    lines = read_step_trace(path)
    assert len(lines) == llm.engine.counters.engine_steps
    assert all(line["pid"] == lines[0]["pid"] and line["seconds"] > 0 for line in lines)
    starts = [line["start"] for line in lines]
    assert starts == sorted(starts)
    # Every prompt token is computed once in a prefill chunk; the first sampled token comes from the
    # prompt's last chunk, every later one from a decode row (a 40-token prompt is two chunks under
    # the 32-token budget, which also caps each step).
    assert sum(line["prefill_tokens"] for line in lines) == 40 + 7 + 19
    assert (
        sum(line["decode_rows"] for line in lines) == sum(len(o.outputs[0].token_ids) - 1 for o in outs) == 15
    )
    assert max(line["prefill_tokens"] + line["decode_rows"] for line in lines) <= 32
    assert lines[0]["waiting"] >= 1  # the budget left requests waiting after the first plan
    # Each request is listed once, at the step that first scheduled it, with an arrival before it.
    arrivals = [(a, line["start"]) for line in lines for a in line.get("arrivals", [])]
    assert len(arrivals) == 3
    assert all(a <= start for a, start in arrivals)
    # What a replay needs (tandem/sim/replay_run.py): each request taken in once, before the step
    # after it, with its arrival; its first token's step and the step that finished it, once each.
    added = [(rid, at, arrival, line["start"]) for line in lines for rid, at, arrival in line.get("added", [])]
    assert len(added) == len({rid for rid, *_ in added}) == 3
    assert all(arrival <= at < start for _, at, arrival, start in added)
    firsts = [rid for line in lines for rid in line.get("first", [])]
    done = {rid: n for line in lines for rid, n in line.get("done", [])}
    assert sorted(firsts) == sorted(done) == sorted(rid for rid, *_ in added)
    assert set(done.values()) == {6}
    step_of = {rid: k for k, line in enumerate(lines) for rid in line.get("first", [])}
    assert all(step_of[rid] <= k for k, line in enumerate(lines) for rid, _ in line.get("done", []))
    # A second engine appends to the same file.
    LLM(str(model_factory("llama")), num_kv_blocks=64, step_trace=str(path)).generate(
        prompts[:1], params, use_tqdm=False
    )
    assert len(read_step_trace(path)) > len(lines)


def test_loop_gaps_are_each_engines_busy_gaps_only():
    """Gaps are taken per engine process (two engines' steps interleave in one file) and only
    where the engine stayed busy: a pause longer than BUSY_GAP_S is idleness, not loop work."""
    from tandem.engine.step_trace import BUSY_GAP_S, loop_gaps

    def line(pid: int, start: float, seconds: float) -> dict:
        return {"pid": pid, "start": start, "seconds": seconds}

    lines = [
        line(1, 0.000, 0.010),
        line(2, 0.001, 0.020),
        line(1, 0.011, 0.010),  # gap 1 ms (pid 1)
        line(2, 0.023, 0.020),  # gap 2 ms (pid 2)
        line(1, 0.021 + 2 * BUSY_GAP_S, 0.010),  # idle, not a gap
    ]
    assert sorted(loop_gaps(lines)) == [pytest.approx(0.001), pytest.approx(0.002)]
    assert loop_gaps([]) == []


def test_idle_arrival_waits_keep_requests_that_found_their_engine_idle():
    """The way into the engine: a request that arrived while its engine was between steps counts
    (arrival to the start of the step that scheduled it); one that arrived during a step also
    waited for the step's rest, and is left out. Engines are taken apart."""
    from typing import Any

    from tandem.engine.step_trace import idle_arrival_waits

    lines: list[dict[str, Any]] = [
        {"pid": 1, "start": 1.000, "seconds": 0.100, "arrivals": [0.999]},  # idle before: 1 ms
        {"pid": 1, "start": 1.101, "seconds": 0.010, "arrivals": [1.050]},  # arrived mid-step
        {"pid": 2, "start": 1.050, "seconds": 0.010, "arrivals": [1.048, 1.047]},  # other engine, idle
        {"pid": 1, "start": 2.000, "seconds": 0.010, "arrivals": [1.997]},  # idle again: 3 ms
        {"pid": 1, "start": 2.010, "seconds": 0.010},
    ]
    assert sorted(idle_arrival_waits(lines)) == [
        pytest.approx(0.001),
        pytest.approx(0.002),
        pytest.approx(0.003),
        pytest.approx(0.003),
    ]
    assert idle_arrival_waits([]) == []


def test_the_front_end_writes_when_it_placed_and_released_each_request(tokenizer_dir, tmp_path):
    """The API process's lines of a step trace (engine/front_trace.py): a request's placement and
    its release from the dispatcher's count when its end is delivered, on the file the engines
    write; `read_step_trace` leaves them out and `front_end_events` reads them."""
    import asyncio
    from types import SimpleNamespace

    from tandem.cluster.build import build_cluster
    from tandem.cluster.config import ClusterConfig
    from tandem.core.engine_io import EngineCoreRequest, SampleOutput
    from tandem.engine import messages as m
    from tandem.engine.core_client import AsyncEngineClient
    from tandem.engine.processor import OutputProcessor
    from tandem.engine.step_trace import front_end_events
    from tandem.engine.tokenizer import Tokenizer

    class Sink:
        def send(self, payload: bytes) -> None:
            pass

    path = tmp_path / "steps.jsonl"
    path.write_text('{"pid":1,"start":1.0,"seconds":0.01,"prefill_tokens":3}\n')  # an engine's step
    cluster = ClusterConfig(num_instances=2, dispatch_policy="least_load")
    parts = build_cluster(cluster, None, [64, 64], 16)  # type: ignore[arg-type]
    config = SimpleNamespace(step_trace=str(path))
    c = AsyncEngineClient(config=config, connections=[Sink(), Sink()])  # type: ignore[arg-type,list-item]
    c.dispatcher = parts.dispatcher
    c.instances.live = {0, 1}
    c.outputs = OutputProcessor(Tokenizer(str(tokenizer_dir)))
    for rid in ("a", "b"):
        c.add(EngineCoreRequest(rid, [1, 2, 3], SamplingParams(max_tokens=1), 1, 0.0), None, asyncio.Event())
    run = c.router.table.runs["a"]
    c._handle(c.routes["a"], m.Outputs([SampleOutput("a", 0, [7], None, finish_reason="length", incarnation=run)]))
    c.front_trace.close()  # type: ignore[union-attr]
    assert read_step_trace(path) == [{"pid": 1, "start": 1.0, "seconds": 0.01, "prefill_tokens": 3}]
    events = front_end_events(path)
    assert set(events["placed"]) == {"a", "b"} and set(events["released"]) == {"a"}
    assert events["placed"]["a"] <= events["placed"]["b"] <= events["released"]["a"]


@pytest.mark.slow
def test_a_live_move_writes_its_acts_on_both_engines_and_the_front_end(llama_dir, tmp_path):
    """Two engine processes and the front end sharing one step trace: a live move of a request
    (held running: ignore_eos, 300 tokens) writes the front end's decision and outcome, the
    source's begin, stage(s), pause and end, the destination's accept and install, each act with
    the count of its engine's step lines before it."""
    import asyncio

    from tandem.config import EngineConfig
    from tandem.engine.connection import ProcessConnection
    from tandem.engine.core_client import AsyncEngineClient
    from tandem.engine.step_trace import move_lines

    path = tmp_path / "steps.jsonl"
    config = EngineConfig(
        model=str(llama_dir), num_kv_blocks=256, num_threads=1, block_size=4, max_num_seqs=4, step_trace=str(path)
    )

    async def serve() -> list[int]:
        client = AsyncEngineClient(config, connections=[ProcessConnection(config), ProcessConnection(config)])
        await client.start(timeout=300)
        try:
            assert client.inputs is not None
            params = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
            req, text = client.inputs.process("r0", {"prompt_token_ids": list(range(5, 45))}, params)
            stream = client.add(req, text, asyncio.Event(), instance=0)
            while not stream.started:
                await asyncio.sleep(0.005)
            assert client.migrate_live("r0", 1)
            while True:
                await asyncio.sleep(0.01)
                out = stream.take()
                if out is not None and out.finished:
                    return list(out.outputs[0].token_ids)
        finally:
            await client.shutdown()

    tokens = asyncio.run(serve())
    assert len(tokens) == 300
    moves = move_lines(path)
    kinds = [m["move"] for m in moves]
    for kind in ("decided", "begin", "accept", "pause", "install", "end", "landed"):
        assert kinds.count(kind) == 1, kinds
    assert kinds.count("stage") >= 1
    by_kind = {m["move"]: m for m in moves}
    assert by_kind["end"]["outcome"] == by_kind["landed"]["outcome"] == "completed"
    source, destination = by_kind["begin"]["pid"], by_kind["install"]["pid"]
    assert source != destination and by_kind["accept"]["pid"] == destination
    assert all(m["pid"] == source for m in moves if m["move"] in ("stage", "pause", "end"))
    front = by_kind["decided"]["pid"]
    assert front not in (source, destination) and by_kind["decided"]["destination"] == 1
    # Each act's `step`: its engine's step lines written before it (the plane acts between steps).
    lines = read_step_trace(path)
    for m in moves:
        if m["pid"] != front:
            assert m["step"] == sum(1 for line in lines if line["pid"] == m["pid"] and line["start"] <= m["at"]), m
    order = [m["move"] for m in sorted(moves, key=lambda m: m["at"])]
    assert order.index("decided") < order.index("begin") < order.index("pause") < order.index("install")
    assert order.index("install") < order.index("end") < order.index("landed")
