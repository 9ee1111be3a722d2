"""The scheduler with prefix caching on, driven by the fake runner of tests/scheduler_harness.py.

After every step the harness checks the pool and the radix tree (`kv.check_invariants()`), that every
block's refcount is the number of live block tables holding it plus one if the tree owns it, that the
blocks are conserved (free + cached only + held == all), that each node's lock count is the number of
running requests whose path goes through it, that every cached block still holds the KV of the tokens
on its path (so no block a request or the cache holds was reused), and what each admitted request got
from the cache against what an ideal cache holding everything computed so far would give it. At the end
every lock is back to zero. Outputs must be token-identical to a run without caching.
"""

from __future__ import annotations

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from scheduler_harness import (
    VOCAB,
    GroupSpec,
    Harness,
    Workload,
    expected_outputs,
    make_group,
    outputs,
    reference_output,
    run_workload,
)

from tandem.core.request import RequestStatus

SALTS = (None, None, "a", "b")


@st.composite
def cache_workloads(draw) -> Workload:
    """Prompts built from a few shared stems cut at random points (so they diverge mid-block), short
    suffixes over a tiny alphabet (so suffixes collide too), exact repeats, n > 1 groups, cache salts."""
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    max_num_seqs = draw(st.integers(1, 5))
    stems = draw(
        st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=4, max_size=36), min_size=1, max_size=3)
    )
    groups: list[GroupSpec] = []
    for k in range(draw(st.integers(2, 7))):
        kind = draw(st.sampled_from(["stem", "stem", "cut", "repeat", "fresh"]))
        if kind == "repeat" and groups:
            prompt = list(draw(st.sampled_from(groups)).prompt)  # an exact repeat
        elif kind == "fresh":
            prompt = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20))
        else:
            stem = draw(st.sampled_from(stems))
            cut = len(stem) if kind == "stem" else draw(st.integers(0, len(stem)))
            prompt = stem[:cut] + draw(st.lists(st.integers(0, 2), min_size=0 if cut else 1, max_size=8))
        max_tokens = draw(st.integers(1, 12))
        groups.append(
            GroupSpec(
                rid=f"g{k}",
                prompt=tuple(prompt),
                max_tokens=max_tokens,
                n=draw(st.sampled_from([1, 1, 2, 3]).map(lambda n: min(n, max_num_seqs))),
                mode=draw(st.sampled_from(["ignore_eos", "ignore_eos", "eos", "stop_token"])),
                stop=draw(st.integers(0, VOCAB - 1)),
                min_tokens=draw(st.integers(0, max_tokens)),
                arrival=draw(st.integers(0, 4)) * draw(st.integers(0, 4)),
                cache_salt=draw(st.sampled_from(SALTS)),
            )
        )
    return Workload(
        block_size=block_size,
        max_num_batched_tokens=draw(st.integers(1, 32)),
        max_num_seqs=max_num_seqs,
        groups=tuple(groups),
        extra_blocks=draw(st.integers(0, 4)),
        aborts=tuple(draw(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 100)), max_size=3))),
    )


@settings(max_examples=70, deadline=None)
@given(w=cache_workloads())
def test_random_workloads_with_prefix_caching(w: Workload) -> None:
    """Random shared-prefix workloads with caching on, in an ample cache and in a tight one.

    Ample (every sample at full length fits at once, with room to keep all computed KV cached): no
    preemption, no eviction, and every admission gets exactly the longest block-aligned prefix computed
    so far under its salt. Tight (the fewest blocks that admit the largest request): preemption and
    eviction; a hit is never longer than the ideal one. Both give the tokens of a run without caching
    in a huge cache (and of the scheduler-free reference).
    """
    expected = {}
    for g in w.groups:
        _, members = g.build()
        for m in members:
            expected[m.request_id] = reference_output(
                m.prompt_token_ids, m.sampling, m.max_tokens, m.eos_token_ids, m.sample_index, w.max_model_len
            )

    plain = run_workload(w, 4 * w.ample_blocks, ())
    assert plain.sched.counters.num_preemptions == 0
    for rid, r in plain.members.items():
        assert (r.output_token_ids, r.status) == expected[rid]

    ample = run_workload(w, w.ample_blocks, (), enable_prefix_caching=True)
    assert ample.sched.counters.num_preemptions == 0 and ample.num_evictions == 0
    for rid, matched, ideal in ample.admissions:
        assert matched == ideal, f"{rid} got {matched} cached tokens, {ideal} were cached"
    for rid, r in ample.members.items():
        assert (r.output_token_ids, r.status) == (
            plain.members[rid].output_token_ids,
            plain.members[rid].status,
        )
    assert ample.sched.counters.prefix_cache_hits == sum(r.num_cached_tokens for r in ample.members.values())

    tight = run_workload(w, w.tight_blocks, w.aborts, enable_prefix_caching=True)
    for rid, r in tight.members.items():
        ref = plain.members[rid]
        if r.status == RequestStatus.FINISHED_ABORTED:
            assert r.output_token_ids == ref.output_token_ids[: r.num_output_tokens]
        else:
            assert r.output_token_ids == ref.output_token_ids, f"{rid} changed by caching or preemption"
            assert r.status == ref.status

    hits = sum(m for _, m, _ in ample.admissions)
    event("ample: cache hits" if hits else "ample: no cache hit")
    if any(m for _, m, _ in tight.admissions):
        event("tight: cache hits")
    if any(m < i for _, m, i in tight.admissions):
        event("tight: a hit shortened by eviction")
    if tight.num_evictions:
        event("tight: evicted")
    if tight.sched.counters.num_preemptions:
        event("tight: preempted")
        if any(m and tight.members[rid].num_preemptions for rid, m, _ in tight.admissions):
            event("tight: a resumed request reused its own cached KV")
    if tight.runner.num_copies or ample.runner.num_copies:
        event("copy-on-write")


# -- targeted scenarios ----------------------------------------------------


def shared_prefix_prompts(prefix_len: int, num: int) -> list[list[int]]:
    prefix = [(7 * i + 3) % VOCAB for i in range(prefix_len)]
    # Distinct suffixes whose first tokens differ: the prompts diverge right after the prefix.
    return [[*prefix, k, (k + 5) % VOCAB, 1, 2, 3, k % 3] for k in range(num)]


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("prefix_len", [64, 66])
def test_shared_prefix_reaches_the_ideal_hit_count(prefix_len: int, block_size: int) -> None:
    """Eight requests sharing a prefix; the first is submitted one step before the others.

    Step 0 computes the first prompt whole (large budget) and caches its full blocks; step 1 admits the
    other seven together, and each finds the whole block-aligned part of the shared prefix cached:
    7 * floor(prefix_len / block_size) * block_size hit tokens, the most any cache could give (a prefix
    of 66 tokens diverges mid-block for block sizes 4 and 16, and only whole blocks are shared).
    """
    prompts = shared_prefix_prompts(prefix_len, 8)
    h = Harness(200, block_size, 8, 1024, max_model_len=128, enable_prefix_caching=True)
    h.add(*make_group("r0", prompts[0], max_tokens=8))
    h.step()
    for k in range(1, 8):
        h.add(*make_group(f"r{k}", prompts[k], max_tokens=8))
    out = h.step()
    assert [r.request_id for r in out.requests] == [f"r{k}" for k in range(8)]
    ideal = prefix_len // block_size * block_size
    assert [h.members[f"r{k}"].num_cached_tokens for k in range(8)] == [0] + [ideal] * 7
    h.drain(max_steps=100)
    assert h.sched.counters.prefix_cache_hits == 7 * ideal
    assert h.sched.counters.prefix_cache_queries == sum(len(p) for p in prompts)
    assert outputs(h) == expected_outputs(h)
    assert all(matched == i for _, matched, i in h.admissions)


def test_requests_admitted_together_cannot_share() -> None:
    """All eight submitted together with a large budget are admitted in the same step, before anything
    is computed: the ideal (and actual) hit count for this admission pattern is zero."""
    prompts = shared_prefix_prompts(64, 8)
    h = Harness(200, 4, 8, 1024, max_model_len=128, enable_prefix_caching=True)
    for k in range(8):
        h.add(*make_group(f"r{k}", prompts[k], max_tokens=8))
    out = h.step()
    assert len(out.requests) == 8
    # All eight computed the prefix; the tree adopted r0's blocks and the others switched to them,
    # dropping their duplicates: 16 shared prefix blocks + 2 private blocks each (tokens 64..69).
    r0 = h.members["r0"]
    assert all(h.members[f"r{k}"].block_ids[:16] == r0.block_ids[:16] for k in range(8))
    assert h.kv.pool.num_used == 16 + 8 * 2
    h.drain(max_steps=100)
    assert h.sched.counters.prefix_cache_hits == 0
    assert outputs(h) == expected_outputs(h)
    # Afterwards the prefix is cached once (duplicates were not adopted): a ninth request hits it.
    h.add(*make_group("late", shared_prefix_prompts(64, 9)[8], max_tokens=2))
    h.drain(max_steps=200)
    assert h.members["late"].num_cached_tokens == 64


def test_concurrent_requests_share_as_soon_as_the_prefix_is_computed() -> None:
    """Submitted together with a small budget (16 tokens a step), the first prompt is prefilled in
    chunks, and the others are admitted only once it is done with its prompt (running requests take
    the budget first). Blocks are cached every step, not when a request finishes: every later request
    hits the whole 64-token prefix while the first is still running (it decodes 30 tokens)."""
    prompts = shared_prefix_prompts(64, 8)
    h = Harness(200, 4, 8, 16, max_model_len=128, enable_prefix_caching=True)
    for k in range(8):
        h.add(*make_group(f"r{k}", prompts[k], max_tokens=30))
    r0 = h.members["r0"]
    admitted_while_r0_runs = 0
    while h.sched.has_unfinished():
        waiting_before = {r.request_id for r in h.sched.waiting}
        out = h.step()
        for r in out.requests:
            if r.request_id in waiting_before and r is not r0:
                assert r0.status == RequestStatus.RUNNING
                admitted_while_r0_runs += 1
        assert h.num_steps < 400
    h.check_end()
    assert admitted_while_r0_runs == 7
    assert [h.members[f"r{k}"].num_cached_tokens for k in range(8)] == [0] + [64] * 7
    assert h.sched.counters.prefix_cache_hits == 7 * 64
    assert outputs(h) == expected_outputs(h)


def test_recomputing_cached_tokens_switches_to_the_cached_blocks() -> None:
    """g1 matches nothing (its one-token prompt leaves nothing to match), then computes the very tokens
    g0 left cached. It must use the cached blocks rather than hold a duplicate of each and lock the
    cached one too: else it needs 5 blocks in a 4-block cache it fits alone, and preempts itself."""
    h = Harness(4, 1, 1, 1, enable_prefix_caching=True)
    h.add(*make_group("g0", [0], max_tokens=2))
    h.add(*make_group("g1", [0], max_tokens=3))
    h.drain(max_steps=20)
    assert h.sched.counters.num_preemptions == 0 and h.num_evictions == 0
    assert h.num_steps == 2 + 3
    assert outputs(h) == expected_outputs(h)


def test_different_salts_never_share() -> None:
    prompt = list(range(20))
    h = Harness(64, 4, 4, 256, enable_prefix_caching=True)
    h.add(*make_group("first", prompt, max_tokens=2, cache_salt="a"))
    h.drain(max_steps=20)
    for rid, salt in (("b", "b"), ("none", None), ("b-again", "b")):
        h.add(*make_group(rid, prompt, max_tokens=2, cache_salt=salt))
        h.drain(max_steps=40)
    # "b-again" hits what "b" computed; nothing crosses salts.
    assert {rid: h.members[rid].num_cached_tokens for rid in ("first", "b", "none", "b-again")} == {
        "first": 0,
        "b": 0,
        "none": 0,
        "b-again": 16,
    }
    assert h.sched.counters.prefix_cache_hits == 16
    assert h.kv.cache is not None and set(h.kv.cache.roots) >= {"a", "b", None}


def test_different_salts_never_share_concurrently() -> None:
    """Many requests with one prompt under three salts, interleaved: hits only within a salt."""
    prompt = [5, 4, 3, 2, 1] * 4
    h = Harness(80, 2, 3, 24, enable_prefix_caching=True)
    salts = ["x", "y", None] * 4
    for k, salt in enumerate(salts):
        h.add(*make_group(f"s{k}", prompt, max_tokens=3, cache_salt=salt))
        h.step()
    h.drain(max_steps=300)
    first_of_salt: dict[str | None, str] = {}
    for k, salt in enumerate(salts):
        first_of_salt.setdefault(salt, f"s{k}")
    for k, salt in enumerate(salts):
        r = h.members[f"s{k}"]
        if first_of_salt[salt] == r.request_id:
            assert r.num_cached_tokens == 0, f"{r.request_id} hit another salt's KV"
    assert all(m == i for _, m, i in h.admissions)  # each hit exactly what its own salt had computed
    assert outputs(h) == expected_outputs(h)


def test_idle_cached_blocks_are_evicted_for_new_work_and_count_as_available() -> None:
    h = Harness(10, 2, 2, 64, enable_prefix_caching=True)
    a = [1, 2, 3, 4, 5, 6, 7]
    h.add(*make_group("a", a, max_tokens=3))
    h.drain(max_steps=20)
    cache = h.kv.cache
    assert cache is not None
    # a's 9 computed tokens left 4 full blocks cached; nothing holds them, so they count as free.
    assert cache.num_cached_blocks == cache.num_unlocked_blocks == 4
    assert h.kv.usage == 0.0 and h.kv.num_available == 10 and h.kv.pool.num_free == 6
    # A different prompt needing 8 blocks must evict 2 of them (the tail of a's path: LRU leaf first).
    h.add(*make_group("b", [9] * 15, max_tokens=1))
    h.step()
    assert h.num_evictions == 2
    assert cache.match_len(a, None) == 4
    h.drain(max_steps=40)
    # a again: the two surviving blocks hit.
    h.add(*make_group("a2", a, max_tokens=3))
    h.drain(max_steps=60)
    assert h.members["a2"].num_cached_tokens == 4
    assert outputs(h) == expected_outputs(h)


def test_preempted_request_resumes_from_its_cached_blocks() -> None:
    """A victim's computed blocks go to the cache when it is preempted; when it resumes (nothing
    having evicted them) it recomputes only what was not cached."""
    h = Harness(9, 2, 2, 64, keep_outputs=True, enable_prefix_caching=True)
    h.add(*make_group("a", [1, 2, 3, 4, 5], max_tokens=10))  # computes 14 tokens: 7 blocks
    h.add(*make_group("b", [6, 7, 8], max_tokens=10))  # computes 12 tokens: 6 blocks
    while not any(o.preempted for o in h.outputs):
        assert h.num_steps < 20
        h.step()
    (victim,) = h.outputs[-1].preempted
    assert victim.request_id == "b"
    # b had computed 8 tokens (4 full blocks, all cached when it was preempted); a took the last one
    # for its new block in the same step (b's tail: the least recently used idle leaf).
    assert victim.num_tokens - 1 == 8 and h.num_evictions == 1
    assert h.kv.cache is not None and h.kv.cache.match_len(victim.token_ids, None) == 6
    h.drain(max_steps=100)
    # a needed 2 more blocks and evicted 2 more from b's tail; b got back its first 2 blocks.
    resumed = [(m, ideal) for rid, m, ideal in h.admissions if rid == "b"][1:]
    assert resumed == [(4, 8)]
    assert victim.num_preemptions == 1
    assert outputs(h) == expected_outputs(h)


def test_forked_samples_share_cached_prompt_and_locks_drop_to_zero() -> None:
    h = Harness(64, 4, 8, 64, enable_prefix_caching=True)
    prompt = list(range(10))
    h.add(*make_group("g", prompt, max_tokens=6, n=3))
    h.step()
    cache = h.kv.cache
    assert cache is not None
    # Two full prompt blocks are cached, locked by the leader and both forked children.
    (node,) = [n for n in cache.roots[None].children.values()]
    assert node.blocks == h.members["g"].block_ids[:2] and node.lock == 3
    h.add(*make_group("again", prompt, max_tokens=2, n=2))
    h.drain(max_steps=50)
    assert h.members["again"].num_cached_tokens == 8
    assert cache.num_unlocked_blocks == cache.num_cached_blocks
    assert outputs(h) == expected_outputs(h)


def test_many_distinct_salts_come_and_go_without_growing_the_tree() -> None:
    """Thousands of requests, each with its own cache salt (as a client sending a fresh `cache_salt`
    every time would), through a small cache: a salt's root goes once its blocks are evicted and no
    request holds it, so the tree never holds more roots than it has cached blocks plus running
    requests, whatever the number of salts seen. Short prompts (nothing to cache) and n > 1 groups
    (forks share the leader's node) leave nothing behind either; the harness checks every block after
    every step, and the cache empties completely at the end."""
    h = Harness(24, 2, 4, 32, enable_prefix_caching=True)
    cache = h.kv.cache
    assert cache is not None
    most = 0
    for k in range(3000):
        prompt = [k % 7, 1, 2, 3, 4] if k % 5 else [k % 7]  # every fifth is shorter than a block
        h.add(*make_group(f"r{k}", prompt, max_tokens=2, n=2 if k % 11 == 0 else 1, cache_salt=f"salt-{k}"))
        h.step()
        most = max(most, len(cache.roots))
        assert len(cache.roots) <= cache.num_cached_blocks + len(h.sched.running)
    h.drain(max_steps=5000)
    assert most <= 24 + 4
    assert all(root.children for root in cache.roots.values()), "an empty root outlived its requests"
    cache.evict(h.kv.num_blocks)
    assert cache.roots == {} and h.kv.pool.num_free == h.kv.num_blocks
    assert outputs(h) == expected_outputs(h)
