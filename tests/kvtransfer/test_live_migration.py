"""Live migration between engine cores: staged KV copy, stop-and-copy, hand-over. Requests moved at
exact points (mid-prefill, after the first token, mid-decode; with n > 1, prefix-cache hits,
speculative decoding) produce the single engine's greedy tokens, each once, and leave no block,
seat or reservation behind on either side."""

from __future__ import annotations

import random
import time

import pytest
from cluster_harness import Cluster

from tandem import LLM, SamplingParams
from tandem.config import EngineConfig
from tandem.engine.messages import EngineCoreRequest

PROMPTS = [list(range(5, 5 + 37)), [21, 22, 23], list(range(30, 30 + 21)), [40, 41, 42, 43, 44]]


def config(model_dir, **kw) -> EngineConfig:
    base = dict(model=str(model_dir), num_kv_blocks=96, num_threads=1, block_size=4, max_num_seqs=8)
    base.update(kw)
    return EngineConfig(**base)


def reference(cfg: EngineConfig, prompt: list[int], params: SamplingParams) -> list[list[int]]:
    llm = LLM(
        cfg.model,
        num_kv_blocks=cfg.num_kv_blocks,
        num_threads=1,
        block_size=cfg.block_size,
        speculative_config=cfg.speculative_config,
    )
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    return [list(c.token_ids) for c in out.outputs]


def run(cfg: EngineConfig, tmp_path, cases, moves) -> Cluster:
    """`cases`: (prompt, params); `moves`: tick -> list of (request index, destination)."""
    cluster = Cluster(cfg, tmp_path)
    try:
        for i, (prompt, params) in enumerate(cases):
            cluster.add(EngineCoreRequest(f"r{i}", prompt, params, params.max_tokens, 0.0), 0)
        tick = 0
        while not cluster.done():
            for i, dest in moves.get(tick, []):
                cluster.wait_moved(f"r{i}")
                cluster.migrate(f"r{i}", dest)
            cluster.tick()
            tick += 1
            assert tick < 3000
        cluster.settle()
        for node in cluster.nodes:
            node.check_idle()
    finally:
        cluster.close()
    return cluster


GREEDY = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)


@pytest.mark.parametrize("tick", [0, 2, 6, 12])
def test_one_migration_at_each_point(llama_dir, tmp_path, tick):
    # The 37-token prompt takes five 8-token steps, the short one is admitted in the fifth. Tick 0:
    # both wait (nothing computed: they are resumed there instead); 2: the long one mid-prefill;
    # 6: the short one right after its first token; 12: both mid-decode.
    cfg = config(llama_dir, max_num_batched_tokens=8)
    cases = [(PROMPTS[0], GREEDY), (PROMPTS[1], GREEDY)]
    cluster = run(cfg, tmp_path, cases, {tick: [(0, 1), (1, 1)]})
    assert cluster.migrated + cluster.recomputed == 2, cluster.abandoned
    assert cluster.migrated == {0: 0, 2: 1, 6: 2, 12: 2}[tick]
    for i, (prompt, params) in enumerate(cases):
        assert [cluster.requests[f"r{i}"].tokens[j] for j in range(params.n)] == reference(
            cfg, prompt, params
        )


@pytest.mark.parametrize("tick", [0, 2])
def test_prompt_logprobs_across_a_move(llama_dir, tmp_path, tick):
    """Moved before its first chunk's output is seen (resumed there: the prompt is computed again,
    and its logprobs sent again, which the front end skips) or mid-prefill (live: each sent once):
    in order, no gap, equal to one engine's."""
    cfg = config(llama_dir, max_num_batched_tokens=8)
    prompt = PROMPTS[0]
    # 64 tokens: the request outlives the live move on a loaded machine (with 4 it could finish first).
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, prompt_logprobs=2)
    cluster = run(cfg, tmp_path, [(prompt, params)], {tick: [(0, 1)]})
    assert cluster.migrated == (tick == 2) and cluster.recomputed == (tick == 0)
    got: list = []
    for start, lps in cluster.requests["r0"].prompt_logprobs:
        assert start <= len(got) + 1  # never a gap
        if tick == 2:
            assert start == len(got) + 1  # a live move sends nothing twice
        for j, lp in enumerate(lps, start=start):
            if j <= len(got):
                assert abs(got[j - 1].logprob - lp.logprob) < 1e-5
            else:
                got.append(lp)
    llm = LLM(cfg.model, num_kv_blocks=cfg.num_kv_blocks, num_threads=1, block_size=cfg.block_size)
    ref = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].prompt_logprobs
    assert len(got) == len(prompt) - 1 == len(ref) - 1
    for j, lp in enumerate(got, start=1):
        assert abs(lp.logprob - ref[j][prompt[j]].logprob) < 1e-5
        assert lp.top_ids == [t for t, v in ref[j].items() if v.rank <= 2]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(n=3, temperature=0.0, max_tokens=25, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, presence_penalty=1.0, min_tokens=30),
        SamplingParams(temperature=0.8, seed=7, max_tokens=30, ignore_eos=True),
    ],
    ids=["n3", "penalties", "seeded"],
)
def test_back_and_forth(llama_dir, tmp_path, params):
    cfg = config(llama_dir, max_num_seqs=16, num_kv_blocks=160)
    rng = random.Random(0)
    moves = {t: [(i, rng.randrange(2)) for i in range(len(PROMPTS))] for t in range(0, 60, 5)}
    cases = [(p, params) for p in PROMPTS]
    cluster = run(cfg, tmp_path, cases, moves)
    assert cluster.migrated >= 8, cluster.abandoned
    for i, (prompt, p) in enumerate(cases):
        assert [cluster.requests[f"r{i}"].tokens[j] for j in range(p.n)] == reference(cfg, prompt, p), i


def test_with_prefix_cache_hits_and_speculation(llama_dir, tmp_path):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    cfg = config(llama_dir, speculative_config=spec)
    shared = PROMPTS[0][:24]
    cases = [([*shared, 7, 8], GREEDY), ([*shared, 9], GREEDY), ([*shared, 7, 8, 9, 10], GREEDY)]
    moves = {2: [(0, 1)], 6: [(1, 1), (2, 1)], 14: [(0, 0)], 20: [(2, 0)]}
    cluster = run(cfg, tmp_path, cases, moves)
    assert cluster.migrated >= 4, cluster.abandoned
    for i, (prompt, p) in enumerate(cases):
        assert cluster.requests[f"r{i}"].tokens[0] == reference(cfg, prompt, p)[0], i


# -- refusals, faults, aborts: the request stays whole, nothing is left held ---------------------


def start(cluster: Cluster, prompt: list[int], params: SamplingParams, ticks: int) -> None:
    cluster.add(EngineCoreRequest("r0", prompt, params, params.max_tokens, 0.0), 0)
    for _ in range(ticks):
        cluster.tick()


def finish(cluster: Cluster, cfg: EngineConfig, prompt: list[int], params: SamplingParams) -> None:
    cluster.settle()
    assert [cluster.requests["r0"].tokens[j] for j in range(params.n)] == reference(cfg, prompt, params)
    for node in cluster.nodes:
        node.check_idle()


@pytest.mark.parametrize("short", ["seats", "blocks"])
def test_destination_without_room_refuses(llama_dir, tmp_path, short):
    cfg = config(llama_dir)
    cluster = Cluster(cfg, tmp_path)
    try:
        start(cluster, PROMPTS[0], GREEDY, 4)
        a, b = cluster.nodes
        if short == "seats":
            b.core.scheduler.reserved_seats = b.core.scheduler.max_num_seqs
        else:
            hog = b.core.kv.pool.allocate(b.core.kv.pool.num_free)
        assert cluster.migrate("r0", 1)
        a.pump_until(lambda: bool(a.reports) or (b.pump() or False), "the refusal")
        cluster._reports(a)
        assert cluster.abandoned and cluster.requests["r0"].node == 0
        if short == "seats":
            b.core.scheduler.reserved_seats = 0
        else:
            b.core.kv.pool.free(hog)
        finish(cluster, cfg, PROMPTS[0], GREEDY)
    finally:
        cluster.close()


def test_silent_destination_times_out(llama_dir, tmp_path):
    # The destination takes the reservation, then never answers again (hung or dead): the source
    # gives the transfer up after the timeout and the request goes on there; the destination
    # frees its reservation on its own timeout.
    cfg = config(llama_dir, kv_transfer_timeout_s=0.3, migration_max_stages=0)
    cluster = Cluster(cfg, tmp_path)
    try:
        start(cluster, PROMPTS[0], GREEDY, 4)
        a, b = cluster.nodes
        assert cluster.migrate("r0", 1)
        b.pump_until(lambda: b.plane.active, "the reservation")
        a.pump_until(lambda: bool(a.core.scheduler.paused), "the hand-over")  # which b never reads
        deadline = time.monotonic() + 5
        while not cluster.abandoned and time.monotonic() < deadline:
            cluster._outputs(0, a.step())
            cluster._reports(a)
        assert cluster.abandoned and "no answer" in cluster.abandoned[0]
        assert not a.core.scheduler.paused
        time.sleep(0.35)
        b.plane.receiver.tick()
        assert not b.plane.active and b.core.scheduler.reserved_seats == 0
        b.pump_until(lambda: b.core.samples("r0") is None and not b.plane.active, "nothing installed")
        finish(cluster, cfg, PROMPTS[0], GREEDY)
    finally:
        cluster.close()


def test_cancel_by_front_end_and_late_cancel_after_install(llama_dir, tmp_path):
    cfg = config(llama_dir, migration_max_stages=0)
    cluster = Cluster(cfg, tmp_path)
    try:
        start(cluster, PROMPTS[0], GREEDY, 4)
        a, b = cluster.nodes
        # Cancelled while the destination reserves: the request stays at the source.
        assert cluster.migrate("r0", 1)
        b.pump_until(lambda: b.plane.active, "the reservation")
        a.plane.sender.cancel("r0", "r0@1")
        cluster._reports(a)
        b.pump_until(lambda: not b.plane.active, "the cancel")
        assert cluster.abandoned == ["the destination is gone"]
        a.pump_until(lambda: not a.plane.socket.poll(50), "the stale Accepted")  # ignored
        # The source gives up after the destination has installed it (its answer is late): the
        # destination's run is aborted on Cancel, the source's goes on.
        assert cluster.migrate("r0", 1)
        b.pump_until(lambda: b.plane.active, "the reservation")
        a.pump_until(lambda: bool(a.core.scheduler.paused), "the hand-over")
        b.pump_until(lambda: b.core.samples("r0") is not None, "the install")
        a.plane.sender.cancel("r0", "r0@2")  # before a reads Installed
        cluster._reports(a)
        assert not a.core.scheduler.paused and a.core.samples("r0") is not None
        b.pump_until(lambda: b.core.samples("r0") is None, "the installed run's abort")
        assert cluster.requests["r0"].node == 0
        finish(cluster, cfg, PROMPTS[0], GREEDY)
    finally:
        cluster.close()


def test_abort_during_migration_leaves_nothing(llama_dir, tmp_path):
    cfg = config(llama_dir, migration_stop_blocks=0, migration_max_stages=8)
    cluster = Cluster(cfg, tmp_path)
    try:
        start(cluster, PROMPTS[0], GREEDY, 4)
        a, b = cluster.nodes
        assert cluster.migrate("r0", 1)
        b.pump_until(lambda: b.plane.active, "the reservation")
        a.plane.handle()  # Accepted: the first stage goes out
        a.pump_until(lambda: a.plane.sender.transfers["r0@1"].num_stages == 1, "the first stage")
        a.core.abort_requests(["r0"])  # the client went away, whatever state the transfer is in
        a.plane.tick()  # the sender sees it gone: Cancel
        assert not a.plane.active
        b.pump_until(lambda: not b.plane.active and b.core.samples("r0") is None, "the cancel")
        del cluster.requests["r0"]
        for node in cluster.nodes:
            node.check_idle()
    finally:
        cluster.close()


def test_transfers_split_into_small_messages(llama_dir, tmp_path, monkeypatch):
    monkeypatch.setattr("tandem.kvtransfer.sender.MAX_PAYLOAD_BYTES", 1)  # one block per message
    cfg = config(llama_dir, migration_stop_blocks=0)
    cases = [
        (PROMPTS[0], GREEDY),
        (PROMPTS[2], SamplingParams(n=2, temperature=0.0, max_tokens=20, ignore_eos=True)),
    ]
    cluster = run(cfg, tmp_path, cases, {8: [(0, 1), (1, 1)], 16: [(0, 0)]})
    assert cluster.migrated == 3, cluster.abandoned
    for i, (prompt, p) in enumerate(cases):
        assert [cluster.requests[f"r{i}"].tokens[j] for j in range(p.n)] == reference(cfg, prompt, p), i
