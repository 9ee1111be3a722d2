"""Live migration between engine cores: staged KV copy while the request decodes, stop-and-copy,
hand-over. Requests moved at exact points (mid-prefill, after the first token, mid-decode; with
n > 1, prefix-cache hits, speculative decoding) produce the single engine's greedy tokens, each
once, leave no block, seat or reservation behind on either side, and cost their destination no
recompute (the harness checks every completed move: `Cluster.check_moves`). The harness delivers
messages and runs timeouts when the test says, so none of this depends on the machine's speed."""

from __future__ import annotations

import random

import pytest
from cluster_harness import Cluster

from tandem import LLM, SamplingParams
from tandem.config import EngineConfig
from tandem.core.engine_io import EngineCoreRequest
from tandem.kvtransfer.protocol import Blocks, Handover, MoveOutcome

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
                cluster.migrate(f"r{i}", dest)  # skipped while its previous move is under way
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
# Long enough that no request can end before a move's outcome whatever the test does meanwhile.
LONG = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)


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


# -- a live move, step by step -----------------------------------------------------------------


def start(cluster: Cluster, prompt: list[int], params: SamplingParams, ticks: int) -> None:
    cluster.add(EngineCoreRequest("r0", prompt, params, params.max_tokens, 0.0), 0)
    for _ in range(ticks):
        cluster.tick()


def finish(cluster: Cluster, cfg: EngineConfig, prompt: list[int], params: SamplingParams) -> None:
    cluster.settle()
    assert [cluster.requests["r0"].tokens[j] for j in range(params.n)] == reference(cfg, prompt, params)
    for node in cluster.nodes:
        node.check_idle()



def test_stages_go_while_the_request_decodes(llama_dir, tmp_path):
    """Stage 1 goes after a step; while it is on its way (the source's inbox held: Staged waits) the
    request decodes 8 tokens on the source; those blocks go as stage 2; only then, with nothing
    more than migration_stop_blocks left, the pause. One stage followed at once by the pause (the
    old loop) fails this."""
    cfg = config(llama_dir, migration_stop_blocks=1, migration_max_stages=4)
    cluster = Cluster(cfg, tmp_path)
    try:
        start(cluster, PROMPTS[0], LONG, 8)
        a, _ = cluster.nodes
        assert cluster.migrate("r0", 1)
        cluster.tick()  # Begin, Accepted
        assert a.messages(Blocks) == []
        with cluster.holding(0):
            cluster.tick()  # stage 1
            for _ in range(8):
                cluster.tick()
            assert len(a.messages(Blocks)) == 1 and a.messages(Handover) == []
        for _ in range(3):
            cluster.tick()
        stage1, stage2 = a.messages(Blocks)
        (handover,) = a.messages(Handover)
        assert stage1.msg.ack and stage2.msg.ack and len(stage2.msg.block_ids) >= 2
        assert stage2.source_tokens - stage1.source_tokens >= 8
        assert handover.source_tokens > stage2.source_tokens
        assert cluster.migrated == 1 and cluster.stages == [2]
        finish(cluster, cfg, PROMPTS[0], LONG)
    finally:
        cluster.close()


def test_a_move_takes_a_step_between_stage_and_pause_by_itself(llama_dir, tmp_path):
    """Nothing held: the default settings still put a step of decoding between the stage and the
    pause, and the destination starts from the source's last computed token."""
    cfg = config(llama_dir)
    cluster = Cluster(cfg, tmp_path)
    try:
        start(cluster, PROMPTS[0], LONG, 10)
        a, b = cluster.nodes
        assert cluster.migrate("r0", 1)
        while cluster.requests["r0"].pending is not None:
            cluster.tick()
        (stage,) = a.messages(Blocks)
        (handover,) = a.messages(Handover)
        assert handover.source_tokens > stage.source_tokens
        moved = len(cluster.requests["r0"].tokens[0])
        # The destination took it over with every token but the last sampled one computed.
        (installed,) = cluster.visits
        assert installed.context == len(PROMPTS[0]) + moved - 1 and installed.decoding
        finish(cluster, cfg, PROMPTS[0], LONG)
        # ...and computed one token a step from there: the rest of the output, nothing else.
        steps = b.computed["r0"]
        assert steps[0][0] == len(PROMPTS[0]) + moved - 1
        assert [n for _, n in steps] == [1] * (LONG.max_tokens - moved)
    finally:
        cluster.close()


def test_with_no_stage_allowed_the_move_is_one_stop_and_copy(llama_dir, tmp_path):
    cfg = config(llama_dir, migration_max_stages=0)
    cluster = Cluster(cfg, tmp_path)
    try:
        start(cluster, PROMPTS[0], LONG, 8)
        a, _ = cluster.nodes
        assert cluster.migrate("r0", 1)
        cluster.tick()
        cluster.tick()
        assert a.messages(Blocks) == [] and len(a.messages(Handover)) == 1
        assert cluster.stages == [0]
        finish(cluster, cfg, PROMPTS[0], LONG)
    finally:
        cluster.close()


# -- refusals, faults, aborts: the request stays whole, nothing is left held ---------------------

@pytest.mark.parametrize("short", ["seats", "blocks"])
def test_destination_without_room_refuses(llama_dir, tmp_path, short):
    cfg = config(llama_dir)
    cluster = Cluster(cfg, tmp_path)
    try:
        start(cluster, PROMPTS[0], LONG, 4)
        _, b = cluster.nodes
        if short == "seats":
            b.core.scheduler.reserved_seats = b.core.scheduler.max_num_seqs
        else:
            hog = b.core.kv.pool.allocate(b.core.kv.pool.num_free)
        assert cluster.migrate("r0", 1)
        cluster.deliver()
        assert cluster.outcomes == [MoveOutcome.REFUSED] and cluster.requests["r0"].node == 0
        if short == "seats":
            b.core.scheduler.reserved_seats = 0
        else:
            b.core.kv.pool.free(hog)
        finish(cluster, cfg, PROMPTS[0], LONG)
    finally:
        cluster.close()


def test_silent_destination_times_out(llama_dir, tmp_path):
    # The destination takes the reservation, then never answers again (hung or dead): the source
    # gives the transfer up after the timeout and the request goes on there; the destination
    # frees its reservation on its own timeout.
    cfg = config(llama_dir, kv_transfer_timeout_s=0.3, migration_max_stages=0)
    cluster = Cluster(cfg, tmp_path)
    try:
        start(cluster, PROMPTS[0], LONG, 4)
        a, b = cluster.nodes
        assert cluster.migrate("r0", 1)
        cluster.tick()  # reserved there
        assert b.plane.active
        with cluster.holding(1):
            cluster.tick()  # the hand-over, which b never reads
            assert a.core.scheduler.paused
            cluster.advance(0.2)
            cluster.tick()
            assert not cluster.outcomes  # within the timeout: still waiting
            cluster.advance(0.2)
            cluster.tick()
            assert cluster.outcomes == [MoveOutcome.ABORTED] and "no answer" in cluster.abandoned[0]
            assert not a.core.scheduler.paused
            assert not b.plane.active and b.core.scheduler.reserved_seats == 0
            assert [d.request_id for d in cluster.dropped] == ["r0"]
        cluster.tick()  # b reads the late Handover and the Cancel: nothing is installed
        assert b.core.samples("r0") is None
        finish(cluster, cfg, PROMPTS[0], LONG)
    finally:
        cluster.close()


def test_cancel_by_front_end_and_late_cancel_after_install(llama_dir, tmp_path):
    cfg = config(llama_dir, migration_max_stages=0)
    cluster = Cluster(cfg, tmp_path)
    try:
        start(cluster, PROMPTS[0], LONG, 4)
        a, b = cluster.nodes
        # Cancelled while the destination reserves: the request stays at the source.
        assert cluster.migrate("r0", 1)
        with cluster.holding(0):
            cluster.deliver()  # b reserves; its Accepted waits
            assert b.plane.active
            a.plane.sender.cancel("r0@1")
        cluster.deliver()  # the stale Accepted is ignored; b drops the reservation on Cancel
        assert cluster.abandoned == ["the destination is gone"] and not b.plane.active
        # The source gives up after the destination has installed it (its answer is late): the
        # destination's run is aborted on Cancel, the source's goes on.
        assert cluster.migrate("r0", 1)
        cluster.tick()  # reserved
        with cluster.holding(0):
            cluster.tick()  # the hand-over; b installs it; its Installed waits
            assert b.core.samples("r0") is not None and a.core.scheduler.paused
            a.plane.sender.cancel("r0@2")  # before a reads Installed
            cluster.deliver()
            assert not a.core.scheduler.paused and a.core.samples("r0") is not None
        cluster.deliver()
        assert b.core.samples("r0") is None
        assert cluster.requests["r0"].node == 0
        finish(cluster, cfg, PROMPTS[0], LONG)
    finally:
        cluster.close()


def test_abort_during_migration_leaves_nothing(llama_dir, tmp_path):
    cfg = config(llama_dir, migration_stop_blocks=0, migration_max_stages=8)
    cluster = Cluster(cfg, tmp_path)
    try:
        start(cluster, PROMPTS[0], LONG, 4)
        a, b = cluster.nodes
        assert cluster.migrate("r0", 1)
        cluster.tick()  # reserved
        with cluster.holding(1):
            cluster.tick()  # the first stage goes out
            assert a.plane.sender.transfers["r0@1"].num_stages == 1
            a.core.abort_requests(["r0"])  # the client went away, whatever state the transfer is in
            a.plane.tick()  # the sender sees it gone: Cancel
            assert not a.plane.active
        cluster.deliver()
        assert not b.plane.active and b.core.samples("r0") is None
        del cluster.requests["r0"]
        for node in cluster.nodes:
            node.check_idle()
    finally:
        cluster.close()


def test_transfers_split_into_small_messages(llama_dir, tmp_path, monkeypatch):
    """One block a message: a stage goes one message a step (its request decoding between), so a
    move takes as many steps as the request has blocks, and still lands exactly."""
    monkeypatch.setattr("tandem.kvtransfer.sender.MAX_PAYLOAD_BYTES", 1)
    cfg = config(llama_dir, migration_stop_blocks=0)
    cases = [
        (PROMPTS[0], LONG),
        (PROMPTS[2], SamplingParams(n=2, temperature=0.0, max_tokens=60, ignore_eos=True)),
    ]
    cluster = run(cfg, tmp_path, cases, {8: [(0, 1), (1, 1)], 40: [(0, 0)]})
    assert cluster.migrated == 3, cluster.abandoned
    for node in cluster.nodes:
        assert all(len(s.msg.block_ids) <= 1 for s in node.messages(Blocks))
    for i, (prompt, params) in enumerate(cases):
        assert [cluster.requests[f"r{i}"].tokens[j] for j in range(params.n)] == reference(cfg, prompt, params), i
