"""Preemption by swap, with the fake runner (tests/scheduler_harness.py): the runner keeps a host
store beside its device store, performs swap-outs, copy-on-write copies and swap-ins in the real
runner's order and poisons what it copied out once nobody holds it, so a request resumed with
anything but its own KV fails its reads or its tokens. The harness checks every step that each
device and host block has the owners it should (none leaked, none owned twice), and at the end that
every sample's tokens were handed out exactly once and equal a reference run without a scheduler.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

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

from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.policy import PRIORITY, SchedulingConfig
from tandem.core.preemption import AUTO, RECOMPUTE, SWAP, PreemptionCost, model_flops
from tandem.core.request import Request, RequestStatus
from tandem.core.scheduler import Scheduler
from tandem.core.step_io import RunnerOutput
from tandem.sampling_params import SamplingParams


def cost(mode: str = SWAP, link: float = 1e9, flops: float = 1e9, block_bytes: int = 1000) -> PreemptionCost:
    return PreemptionCost(
        block_bytes=block_bytes,
        linear_flops_per_token=1e6,
        attention_flops_per_pair=1e3,
        link_bytes_per_s=link,
        flops_per_s=flops,
        mode=mode,
    )


@dataclass
class CoinFlip:
    """A cost model whose choice is a coin flip per victim: swap and recompute mix under pressure."""

    rng: random.Random
    p_swap: float
    mode: str = AUTO
    block_bytes: int = 7

    def swaps(self, num_blocks: int, start: int, end: int) -> bool:
        assert 0 <= start <= end and num_blocks >= 0
        return self.rng.random() < self.p_swap


# -- the invariant test --------------------------------------------------------


@st.composite
def swap_workloads(draw) -> tuple[Workload, int, float, bool, bool, int, str | None]:
    block_size = draw(st.sampled_from([1, 2, 4]))
    max_num_seqs = draw(st.integers(2, 5))
    salts = draw(st.sampled_from([(None,), (None, "a")]))
    shared = draw(st.lists(st.integers(0, VOCAB - 1), min_size=0, max_size=8))
    groups = []
    for k in range(draw(st.integers(3, 7))):
        own = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=16))
        max_tokens = draw(st.integers(2, 12))
        groups.append(
            GroupSpec(
                rid=f"g{k}",
                prompt=tuple((shared if draw(st.booleans()) else []) + own),
                max_tokens=max_tokens,
                n=draw(st.sampled_from([1, 1, 2, 3]).map(lambda n: min(n, max_num_seqs))),
                mode=draw(st.sampled_from(["ignore_eos", "ignore_eos", "eos", "stop_token"])),
                stop=draw(st.integers(0, VOCAB - 1)),
                min_tokens=draw(st.integers(0, max_tokens)),
                arrival=draw(st.integers(0, 6)),
                cache_salt=draw(st.sampled_from(salts)),
                priority=draw(st.integers(0, 2)),
            )
        )
    w = Workload(
        block_size=block_size,
        max_num_batched_tokens=draw(st.integers(1, 24)),
        max_num_seqs=max_num_seqs,
        groups=tuple(groups),
        extra_blocks=draw(st.integers(0, 2)),
        aborts=tuple(draw(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 100)), max_size=3))),
    )
    # Host blocks: from too few for one victim (recompute instead) to plenty.
    num_swap_blocks = draw(st.integers(1, 3 * w.tight_blocks))
    p_swap = draw(st.sampled_from([0.5, 0.9, 1.0]))
    return (
        w,
        num_swap_blocks,
        p_swap,
        draw(st.booleans()),
        draw(st.booleans()),
        draw(st.integers(0, 2**16)),
        draw(st.sampled_from([None, None, "scheduler", "runner"])),
    )


@settings(max_examples=120, deadline=None)
@given(case=swap_workloads())
def test_swap_and_recompute_mixed_under_pressure(case) -> None:
    """Random workloads (shared prefixes, salts, n > 1 forks, stop rules, aborts, the priority
    policy, speculative drafts whose rejected slots a swap-out drops) on a tight KV cache with a swap space of random size, each victim swapped or recomputed
    at random: per step, no device or host block leaks or has two owners (Harness.check_state), a
    swapped request comes back with exactly the tokens it had computed (CheckedKV.swap_in) and
    reads only its own KV (the fake runner); at the end every token was delivered exactly once and
    every sample equals the reference."""
    w, num_swap_blocks, p_swap, prefix_caching, priority, seed, spec_mode = case
    expected = {}
    for g in w.groups:
        for m in g.build()[1]:
            expected[m.request_id] = reference_output(
                m.prompt_token_ids, m.sampling, m.max_tokens, m.eos_token_ids, m.sample_index, w.max_model_len
            )
    h = run_workload(
        w,
        w.tight_blocks,
        w.aborts,
        enable_prefix_caching=prefix_caching,
        config=SchedulingConfig(policy=PRIORITY) if priority else None,
        num_swap_blocks=num_swap_blocks,
        preemption=CoinFlip(random.Random(seed), p_swap),  # type: ignore[arg-type]
        mode=spec_mode,
        seed=seed,
    )
    for rid, r in h.members.items():
        out, status = expected[rid]
        if r.status == RequestStatus.FINISHED_ABORTED:
            assert r.output_token_ids == out[: r.num_output_tokens]
        else:
            assert (r.output_token_ids, r.status) == (out, status), f"{rid} changed by preemption"
    c = h.sched.counters
    assert c.num_preemptions == c.num_swap_outs + c.num_recompute_preemptions
    assert c.num_swap_ins <= c.num_swap_outs
    assert c.swap_out_bytes == 7 * h.runner.num_swapped_out
    assert c.swap_in_bytes == 7 * h.runner.num_swapped_in
    if c.num_swap_outs:
        event("swapped")
    if c.num_recompute_preemptions:
        event("recomputed")
    if c.num_swap_outs and c.num_recompute_preemptions:
        event("swap and recompute in one run")
    if h.runner.num_swapped_in < h.runner.num_swapped_out:
        event("swap-in took blocks back from the prefix cache")
    if h.runner.num_copies:
        event("copy-on-write")


# -- targeted scenarios ---------------------------------------------------------


def three_requests(**kwargs) -> Harness:
    h = Harness(
        num_blocks=6, block_size=2, max_num_seqs=4, max_num_batched_tokens=16, keep_outputs=True, **kwargs
    )
    for k in range(3):
        h.add(*make_group(f"r{k}", [k + 1, 2, 3], max_tokens=9))
    return h


def scheduled_tokens(h: Harness, rid: str) -> int:
    return sum(n for o in h.outputs for r, n in zip(o.requests, o.num_tokens) if r.request_id == rid)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_a_swapped_request_resumes_without_computing_again(prefix_caching) -> None:
    h = three_requests(num_swap_blocks=16, preemption=cost(SWAP), enable_prefix_caching=prefix_caching)
    h.drain(max_steps=200)
    c = h.sched.counters
    assert c.num_swap_outs > 0 and c.num_swap_ins == c.num_swap_outs and c.num_recompute_preemptions == 0
    assert outputs(h) == expected_outputs(h)
    first = next(o for o in h.outputs if o.preempted)
    victim = first.preempted[0]
    assert victim.request_id == "r2" and first.swap_out
    # Every token of each request was computed once: prompt plus outputs but the last, none again.
    for rid, r in h.members.items():
        assert scheduled_tokens(h, rid) == r.num_prompt_tokens + r.num_output_tokens - 1
    # The same run preempting by recompute computes the victim's tokens again.
    again = three_requests()
    again.drain(max_steps=200)
    assert again.sched.counters.num_recompute_preemptions > 0
    assert outputs(again) == outputs(h)
    r2 = again.members["r2"]
    assert scheduled_tokens(again, "r2") > r2.num_prompt_tokens + r2.num_output_tokens - 1


def test_swapped_requests_resume_before_waiting_ones() -> None:
    h = three_requests(num_swap_blocks=16, preemption=cost(SWAP))
    while not any(r.status == RequestStatus.SWAPPED for r in h.sched.waiting):
        h.step()
    h.add(*make_group("late", [9, 9, 9], max_tokens=2))
    swapped = next(r for r in h.sched.waiting if r.status == RequestStatus.SWAPPED)
    assert h.sched.waiting[0] is swapped
    while True:
        out = h.step()
        ids = [r.request_id for r in out.requests]
        if "late" in ids:
            # Admitted only once the swapped request is back (in this step: ahead of it).
            assert swapped.status == RequestStatus.RUNNING and swapped.request_id in ids
            assert ids.index(swapped.request_id) < ids.index("late")
            break
    h.drain(max_steps=200)
    assert outputs(h) == expected_outputs(h)


def test_no_room_in_the_swap_space_falls_back_to_recompute() -> None:
    h = three_requests(num_swap_blocks=1, preemption=cost(SWAP))
    h.drain(max_steps=200)
    c = h.sched.counters
    assert c.num_recompute_preemptions > 0 and c.num_swap_outs == 0
    assert outputs(h) == expected_outputs(h)


def test_forked_samples_keep_their_shared_prompt_on_the_device() -> None:
    """An n = 2 group shares its prompt's blocks: a swapped sample copies only its own blocks and
    keeps its reference on the shared ones (they stay on the device for its sibling)."""
    h = Harness(
        num_blocks=9,
        block_size=2,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        keep_outputs=True,
        num_swap_blocks=16,
        preemption=cost(SWAP),
    )
    h.add(*make_group("g", [1, 2, 3, 4, 5, 6], max_tokens=10, n=2))
    swapped = None
    while h.sched.has_unfinished():
        out = h.step()
        if out.swap_out and swapped is None:
            swapped = out.preempted[0]
            sibling = next(r for r in h.sched.running if r.group_id == "g")
            kept = swapped.block_ids
            assert kept and kept == sibling.block_ids[: len(kept)], "the shared prompt was not kept"
            assert len(out.swap_out) == len(swapped.host_block_ids)
            assert not set(kept) & {d for d, _ in out.swap_out}, "a shared block was copied out"
            assert len(kept) + len(out.swap_out) == -(-swapped.num_computed_tokens // 2)
    h.check_end()
    assert swapped is not None
    assert outputs(h) == expected_outputs(h)


@pytest.mark.parametrize(("num_swap_blocks", "outcome"), [(9, "to host"), (3, "recompute")])
def test_kept_blocks_are_given_up_when_blocks_run_short(num_swap_blocks, outcome) -> None:
    """Three samples share a prompt; once one is swapped out holding the shared blocks, blocks run
    short again: it gives them up before any running sample is preempted, to the swap space with
    the rest of its KV or, without room there, by falling back to recompute (else samples swapped
    out over the prompt could hold it for ever)."""
    h = Harness(
        num_blocks=10,
        block_size=2,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        num_swap_blocks=num_swap_blocks,
        preemption=cost(SWAP),
    )
    h.add(*make_group("g", [1, 2, 3, 4, 5, 6, 7], max_tokens=10, n=3))
    outcomes = []
    while h.sched.has_unfinished():
        holding = [r for r in h.sched.waiting if r.status == RequestStatus.SWAPPED and r.block_ids]
        kept = {b for r in holding for b in r.block_ids}
        out = h.step()
        if any(d in kept for d, _ in out.swap_out):
            outcomes.append("to host")
        outcomes += ["recompute" for r in holding if r.status == RequestStatus.PREEMPTED]
    h.check_end()
    assert outcome in outcomes
    assert outputs(h) == expected_outputs(h)


def test_swap_in_takes_blocks_still_cached_back_from_the_prefix_cache() -> None:
    """With prefix caching, a victim's cached blocks go idle in the cache when it is swapped out; if
    nobody evicted them by the time it comes back, swap-in locks them again instead of copying."""
    h = Harness(
        num_blocks=12,
        block_size=2,
        max_num_seqs=2,
        max_num_batched_tokens=32,
        keep_outputs=True,
        num_swap_blocks=16,
        preemption=cost(SWAP),
        enable_prefix_caching=True,
    )
    h.add(*make_group("a", list(range(1, 9)), max_tokens=12))
    h.add(*make_group("b", list(range(11, 19)), max_tokens=12))
    h.drain(max_steps=200)
    assert h.sched.counters.num_swap_outs > 0
    assert h.runner.num_swapped_in < h.runner.num_swapped_out
    assert outputs(h) == expected_outputs(h)


def test_aborting_a_swapped_request_frees_its_host_blocks() -> None:
    h = three_requests(num_swap_blocks=16, preemption=cost(SWAP))
    while not any(r.status == RequestStatus.SWAPPED for r in h.sched.waiting):
        h.step()
    swapped = next(r for r in h.sched.waiting if r.status == RequestStatus.SWAPPED)
    held = list(swapped.host_block_ids)
    assert held and all(h.kv.swap_pool.refcount(b) == 1 for b in held)  # type: ignore[union-attr]
    h.finish([swapped.request_id])
    assert swapped.host_block_ids == [] and swapped.block_ids == []
    assert all(h.kv.swap_pool.refcount(b) == 0 for b in held)  # type: ignore[union-attr]
    h.drain(max_steps=200)


# -- the cost model ------------------------------------------------------------


def test_the_cost_model_picks_each_way_by_its_constants() -> None:
    # 10 blocks of 1 MB out and back over 1 GB/s: 20 ms. Positions 0..159 again: 160 tokens of
    # 1 GFLOP plus 12880 pairs of 1 MFLOP at 10 TFLOP/s: 17.3 ms; at 1 TFLOP/s, 173 ms.
    fast = PreemptionCost(1_000_000, 1e9, 1e6, link_bytes_per_s=1e9, flops_per_s=1e13)
    slow = PreemptionCost(1_000_000, 1e9, 1e6, link_bytes_per_s=1e9, flops_per_s=1e12)
    assert fast.swap_seconds(10) == pytest.approx(0.02)
    assert fast.recompute_seconds(0, 160) == pytest.approx((160e9 + 12880e6) / 1e13)
    assert not fast.swaps(10, 0, 160)
    assert slow.swaps(10, 0, 160)
    # A kept prefix is not computed again: only positions 120..159 (40 tokens, 5620 pairs).
    assert slow.recompute_seconds(120, 160) == pytest.approx((40e9 + 5620e6) / 1e12)
    assert not slow.swaps(10, 150, 160)
    # The mode overrides the costs.
    assert PreemptionCost(1, 1.0, 1.0, 1.0, 1e30, mode=SWAP).swaps(10**6, 0, 1)
    assert not PreemptionCost(1, 1e30, 1.0, 1e30, 1.0, mode=RECOMPUTE).swaps(1, 0, 10**6)
    with pytest.raises(ValueError, match="preemption_mode"):
        PreemptionCost(1, 1.0, 1.0, 1.0, 1.0, mode="sometimes")


@pytest.mark.parametrize(("link", "swaps"), [(1e12, True), (1e3, False)])
def test_the_scheduler_swaps_or_recomputes_as_the_constants_say(link, swaps) -> None:
    h = three_requests(num_swap_blocks=16, preemption=cost(AUTO, link=link, flops=1e9))
    h.drain(max_steps=200)
    c = h.sched.counters
    assert c.num_preemptions > 0
    assert (c.num_swap_outs, c.num_recompute_preemptions) == (
        (c.num_preemptions, 0) if swaps else (0, c.num_preemptions)
    )
    assert outputs(h) == expected_outputs(h)


def test_model_flops_of_a_dense_and_a_sparse_model() -> None:
    @dataclass
    class Shape:
        hidden_size: int = 64
        intermediate_size: int = 128
        num_layers: int = 2
        num_heads: int = 4
        num_kv_heads: int = 2
        head_dim: int = 16
        moe: object = None

    linear, attention = model_flops(Shape())
    # q, o: 64x64 each; k, v: 64x32 each; gate, up, down: 64x128 each; two layers, 2 FLOPs per weight.
    assert linear == 2 * 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128)
    assert attention == 4 * 2 * 4 * 16

    @dataclass
    class Experts:
        top_k: int = 2
        expert_intermediate_size: int = 32
        shared_expert_intermediate_size: int = 0

        def is_sparse(self, layer: int) -> bool:
            return layer == 1

    sparse, _ = model_flops(Shape(moe=Experts()))
    assert sparse == linear - 2 * 3 * 64 * 128 + 2 * 3 * 64 * 2 * 32


def test_the_kv_manager_owns_the_swap_space() -> None:
    kv = KVCacheManager(4, 2, num_swap_blocks=3)
    assert kv.num_swap_blocks == 3 and kv.swap_pool is not None
    assert KVCacheManager(4, 2).swap_pool is None and KVCacheManager(4, 2).num_swap_blocks == 0
    sched = Scheduler(kv, 2, 3, 16, preemption=cost(SWAP))
    r = Request("x", [1, 2, 3, 4, 5], SamplingParams(max_tokens=1), max_tokens=1)
    sched.add_request(r)
    sched.update(sched.schedule(), RunnerOutput())  # a 3-token chunk of its prompt
    copies: list[tuple[int, int]] = []
    assert kv.swap_plan(r) == (2, 0)
    assert kv.swap_out(r, copies) and len(copies) == 2 and kv.swap_pool.num_free == 1
    assert r.block_ids == [] and r.num_computed_tokens == 3
    kv.check_invariants()
    # Back in: two fresh blocks, the host copies to fill them, the host blocks free again.
    swap_copies: list[tuple[int, int]] = []
    r.status = RequestStatus.SWAPPED
    assert kv.swap_in(r, 1, [], swap_copies)
    assert [h for h, _ in swap_copies] == [h for _, h in copies] and r.block_ids == [
        d for _, d in swap_copies
    ]
    assert kv.swap_pool.num_free == 3 and r.host_block_ids == []
    kv.check_invariants()
