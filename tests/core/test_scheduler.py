"""Scheduler tests with a fake model runner (no torch, no model); see tests/scheduler_harness.py.

The fake runner keeps a simulated paged KV cache: each slot holds the (position, token) written there
and a hash of the sequence it was computed under. It performs the step's copy-on-write copies, writes
every scheduled token through the request's block table (refusing to write into a block that another
request still holds), and, for a request that has caught up, reads its whole history back through the
block table and samples a token that depends only on that history. A paging, copy-on-write or
recompute bug therefore shows up as a runner assertion or as tokens that differ from a reference
computed without any scheduler.
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
    next_token,
    outputs,
    reference_output,
    run_workload,
)

from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.request import Request, RequestStatus
from tandem.core.scheduler import Scheduler
from tandem.sampling_params import SamplingParams

# -- random workloads ------------------------------------------------------


@st.composite
def workloads(draw) -> Workload:
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    max_num_seqs = draw(st.integers(1, 5))
    groups = []
    for k in range(draw(st.integers(1, 6))):
        prompt = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24))
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
                arrival=draw(st.integers(0, 8)),
            )
        )
    return Workload(
        block_size=block_size,
        max_num_batched_tokens=draw(st.integers(1, 20)),
        max_num_seqs=max_num_seqs,
        groups=tuple(groups),
        extra_blocks=draw(st.integers(0, 4)),
        aborts=tuple(draw(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 100)), max_size=3))),
    )


@settings(max_examples=100, deadline=None)
@given(w=workloads())
def test_random_workloads(w: Workload) -> None:
    """Random arrivals, prompts, lengths, n > 1 groups, stop rules and aborts, on a tight KV cache.

    Harness.step checks the per-step invariants (budget, seats, block coverage, refcounts, victim
    rule, no thrash); here: every sample ends with the tokens of a reference computed without a
    scheduler, in an ample cache (no preemption) and in a tight one (preemption likely).
    """
    expected = {}
    for g in w.groups:
        _, members = g.build()
        for m in members:
            expected[m.request_id] = reference_output(
                m.prompt_token_ids, m.sampling, m.max_tokens, m.eos_token_ids, m.sample_index, w.max_model_len
            )

    ample = run_workload(w, w.ample_blocks, ())
    assert ample.sched.counters.num_preemptions == 0
    for rid, r in ample.members.items():
        assert (r.output_token_ids, r.status) == expected[rid]

    tight = run_workload(w, w.tight_blocks, w.aborts)
    for rid, r in tight.members.items():
        ref = ample.members[rid]
        if r.status == RequestStatus.FINISHED_ABORTED:
            assert r.output_token_ids == ref.output_token_ids[: r.num_output_tokens]
        else:
            assert r.output_token_ids == ref.output_token_ids, f"{rid} changed by preemption"
            assert r.status == ref.status
    for h, name in ((ample, "ample"), (tight, "tight")):
        if h.sched.counters.num_preemptions:
            event(f"{name}: preempted")
        if h.runner.num_copies:
            event(f"{name}: copy-on-write")
        if h.protected_victims:
            event(f"{name}: protected victim (every running request protected)")
        if h.stalls:
            event(f"{name}: a protected request waited for blocks")
        if h.num_mixed:
            event(f"{name}: prefill chunk shares a step with a decode")
    event(f"steps/work <= {-(-tight.num_steps * 4 // w.work())}/4")


# -- targeted scenarios ----------------------------------------------------


def test_preemption_recomputes_to_the_same_tokens() -> None:
    h = Harness(num_blocks=6, block_size=2, max_num_seqs=4, max_num_batched_tokens=16, keep_outputs=True)
    for k in range(3):
        h.add(*make_group(f"r{k}", [k + 1, 2, 3], max_tokens=9))
    h.drain(max_steps=200)
    assert h.sched.counters.num_preemptions > 0
    assert outputs(h) == expected_outputs(h)
    first = next(o for o in h.outputs if o.preempted)
    # The latest-admitted request is the victim, nothing is admitted in that step.
    assert first.preempted[0].request_id == "r2"
    assert "r2" not in [r.request_id for r in first.requests]
    # A huge cache gives exactly the same tokens without preempting.
    ample = Harness(num_blocks=64, block_size=2, max_num_seqs=4, max_num_batched_tokens=16)
    for k in range(3):
        ample.add(*make_group(f"r{k}", [k + 1, 2, 3], max_tokens=9))
    ample.drain(max_steps=200)
    assert ample.sched.counters.num_preemptions == 0
    assert outputs(ample) == outputs(h)


def test_preempted_requests_go_back_to_the_front_in_admission_order() -> None:
    h = Harness(num_blocks=4, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    for k in range(4):
        h.add(*make_group(f"r{k}", [k] * 4, max_tokens=12))  # one full block each
    h.step()  # all admitted, one block each, every block used
    assert [r.request_id for r in h.sched.running] == ["r0", "r1", "r2", "r3"]
    assert h.kv.pool.num_free == 0
    out = h.step()  # each needs a second block: r0 pushes out r3, r1 pushes out r2
    assert [r.request_id for r in out.preempted] == ["r3", "r2"]
    assert [r.request_id for r in out.requests] == ["r0", "r1"]
    assert [r.request_id for r in h.sched.waiting] == ["r2", "r3"]
    assert all(r.protected for r in out.preempted)
    h.drain(max_steps=300)
    assert outputs(h) == expected_outputs(h)


def test_resumed_request_is_not_preempted_again_before_it_samples() -> None:
    """A resumed request that cannot get a block waits, keeping its blocks, instead of being thrown out.

    Block size 1, 9 blocks, 2 tokens a step. `a` decodes one token a step; `d`'s 4-token prompt is
    prefilled a token a step beside it. When the cache runs out, `d` (the latest) is preempted; it
    resumes, and at the next shortage `a` (already served this step) took the last block. Preempting
    `d` again would throw away its progress for nothing: it must wait a step instead.
    """
    h = Harness(num_blocks=9, block_size=1, max_num_seqs=2, max_num_batched_tokens=2, keep_outputs=True)
    h.add(*make_group("a", [1], max_tokens=8))
    h.step()
    h.step()
    h.add(*make_group("d", [0, 0, 0, 0], max_tokens=1))
    d = h.members["d"]
    waited = 0
    while h.sched.has_unfinished():
        was_protected = d.protected and d.status == RequestStatus.RUNNING
        out = h.step()
        if was_protected:
            assert d not in out.preempted, "a resumed request was preempted before sampling again"
            if all(r is not d for r in out.requests):
                waited += 1
                assert d.status == RequestStatus.RUNNING and d.block_ids
    h.check_end()
    assert d.num_preemptions == 1
    assert waited >= 1 and h.stalls >= 1
    assert h.num_thrash == 0
    assert outputs(h) == expected_outputs(h)


def test_nothing_is_admitted_while_a_resumed_request_waits_for_blocks() -> None:
    """The free block that the waiting `g3` cannot use yet would fit `g4`; admitting `g4` would take it."""
    h = Harness(num_blocks=7, block_size=1, max_num_seqs=3, max_num_batched_tokens=5)
    for rid, prompt_len, max_tokens in [("g0", 1, 4), ("g1", 1, 1), ("g2", 1, 6), ("g3", 4, 1), ("g4", 1, 1)]:
        h.add(*make_group(rid, [0] * prompt_len, max_tokens))
    g3, g4 = h.members["g3"], h.members["g4"]
    held_back = 0
    while h.sched.has_unfinished():
        g3_waits = g3.status == RequestStatus.RUNNING and g3.protected
        out = h.step()
        if g3_waits and all(r is not g3 for r in out.requests):
            assert g3.status == RequestStatus.RUNNING and g3.num_preemptions == 1
            assert h.kv.pool.num_free >= 1 and g4.status == RequestStatus.WAITING
            held_back += 1
    h.check_end()
    assert held_back >= 1
    assert outputs(h) == expected_outputs(h)


def test_chunked_prefill_shares_steps_with_decodes() -> None:
    h = Harness(num_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=4)
    h.add(*make_group("dec", [5], max_tokens=20))
    out = h.step()
    assert [(r.request_id, n) for r, n in zip(out.requests, out.num_tokens)] == [("dec", 1)]
    long = list(range(10))
    h.add(*make_group("long", long, max_tokens=3))
    plan = []
    for _ in range(4):
        out = h.step()
        plan.append([(r.request_id, n) for r, n in zip(out.requests, out.num_tokens)])
    # The running decode goes first, the prompt gets the rest of the budget each step.
    assert plan == [
        [("dec", 1), ("long", 3)],
        [("dec", 1), ("long", 3)],
        [("dec", 1), ("long", 3)],
        [("dec", 1), ("long", 1)],
    ]
    lr = h.members["long"]
    assert lr.num_output_tokens == 1  # sampled only once the whole prompt was computed
    assert h.members["dec"].num_output_tokens == 5
    h.drain(max_steps=100)
    assert outputs(h) == expected_outputs(h)


def test_budget_one_token_per_step() -> None:
    h = Harness(num_blocks=16, block_size=2, max_num_seqs=3, max_num_batched_tokens=1)
    h.add(*make_group("a", [1, 2, 3], max_tokens=2))
    h.add(*make_group("b", [4], max_tokens=2))
    h.drain(max_steps=50)
    assert h.num_steps == 3 + 1 + 1 + 1  # a's prompt, a's decode, then b's prompt and decode
    assert outputs(h) == expected_outputs(h)


def test_seats_count_pending_children() -> None:
    h = Harness(num_blocks=32, block_size=4, max_num_seqs=3, max_num_batched_tokens=64)
    h.add(*make_group("g", [1, 2, 3], max_tokens=4, n=3))
    h.add(*make_group("solo", [7], max_tokens=2))
    out = h.step()
    # The group takes all three seats before it forks: "solo" must wait.
    assert [r.request_id for r in out.requests] == ["g"]
    assert h.sched.running[0].num_seats == 1 and len(h.sched.running) == 3  # forked after sampling
    assert [r.request_id for r in h.sched.running] == ["g", "g#1", "g#2"]
    assert [r.request_id for r in h.sched.waiting] == ["solo"]
    h.drain(max_steps=50)
    assert outputs(h) == expected_outputs(h)
    assert h.members["solo"].first_scheduled_time >= h.members["g"].finished_time


def test_fork_shares_the_prompt_and_copies_on_write() -> None:
    h = Harness(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, keep_outputs=True)
    leader, members = make_group("g", [3, 1, 4, 1, 5, 9], max_tokens=5, n=3)
    h.add(leader, members)
    h.step()
    blocks = list(leader.block_ids)
    for child in members[1:]:
        assert child.block_ids == blocks
        assert child.num_computed_tokens == leader.num_computed_tokens == 6
    assert [h.kv.pool.refcount(b) for b in blocks] == [3, 3]
    out = h.step()
    # Position 6 lies in the shared, partly filled second block: two of the three get a private copy.
    assert len(out.block_copies) == 2
    assert {src for src, _ in out.block_copies} == {blocks[1]}
    assert h.kv.pool.refcount(blocks[0]) == 3
    h.drain(max_steps=50)
    got = outputs(h)
    assert got == expected_outputs(h)
    assert len({tuple(v) for v in got.values()}) == 3  # the samples diverged


def test_finished_leader_leaves_forked_children_valid_kv() -> None:
    """The leader stops on its first token (a stop token only it samples); its forked children keep
    the prompt KV it wrote and go on alone."""
    prompt = [2, 7, 1, 8, 2]
    stop = next_token(prompt, 0)  # the leader's first token
    assert next_token(prompt, 1) != stop and next_token(prompt, 2) != stop
    h = Harness(num_blocks=12, block_size=2, max_num_seqs=3, max_num_batched_tokens=64)
    h.add(*make_group("g", prompt, max_tokens=6, n=3, stop_token_ids=[stop]))
    h.step()
    assert h.members["g"].status == RequestStatus.FINISHED_STOPPED
    assert [r.request_id for r in h.sched.running] == ["g#1", "g#2"]
    h.drain(max_steps=50)  # the runner checks the children still read the prompt the leader wrote
    assert outputs(h) == expected_outputs(h)


def test_stop_conditions() -> None:
    prompt = [4, 4, 4]
    seq = reference_output(prompt, SamplingParams(max_tokens=20, ignore_eos=True), 20, (), 0, 64)[0]
    h = Harness(num_blocks=32, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    h.add(*make_group("eos", prompt, 20, ignore_eos=False, eos=(seq[3],)))
    h.add(*make_group("ignored", prompt, 20, ignore_eos=True, eos=(seq[3],)))
    h.add(*make_group("stop_id", prompt, 20, stop_token_ids=[seq[2]]))
    h.add(*make_group("min_tokens", prompt, 20, stop_token_ids=[seq[0]], min_tokens=1))
    h.add(*make_group("length", prompt, 5))
    h.drain(max_steps=100)
    m = h.members
    first_at = {t: seq.index(t) for t in set(seq)}
    assert m["eos"].output_token_ids == seq[: first_at[seq[3]] + 1]
    assert m["eos"].status == RequestStatus.FINISHED_STOPPED and m["eos"].stop_reason is None
    assert m["ignored"].output_token_ids == seq and m["ignored"].status == RequestStatus.FINISHED_LENGTH
    assert m["stop_id"].output_token_ids == seq[: first_at[seq[2]] + 1]
    assert m["stop_id"].stop_reason == seq[2]
    # The sampler holds stop tokens back under min_tokens; one it gives all the same (nothing else
    # was allowed) ends the request.
    assert m["min_tokens"].output_token_ids == seq[:1]
    assert m["min_tokens"].status == RequestStatus.FINISHED_STOPPED
    assert m["length"].output_token_ids == seq[:5] and m["length"].status == RequestStatus.FINISHED_LENGTH
    assert outputs(h) == expected_outputs(h)


def test_max_model_len_ends_generation() -> None:
    h = Harness(num_blocks=32, block_size=4, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=10)
    h.add(*make_group("r", [1, 2, 3, 4], max_tokens=6))
    h.drain(max_steps=50)
    r = h.members["r"]
    assert r.num_tokens == 10 and r.status == RequestStatus.FINISHED_LENGTH


# -- admission checks ----------------------------------------------------------


def test_check_fits() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    s = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=8, max_model_len=20)
    s.check_fits(10, 6, 1)  # 16 tokens: exactly the whole cache
    s.check_fits(4, 12, 2)
    with pytest.raises(ValueError, match="max_model_len"):
        s.check_fits(15, 6, 1)
    s2 = Scheduler(KVCacheManager(4, 4), 2, 8, max_model_len=40)
    s2.check_fits(10, 6, 1)
    with pytest.raises(ValueError, match="KV"):
        s2.check_fits(10, 7, 1)  # 17 tokens need 5 blocks of 4
    with pytest.raises(ValueError, match="max_num_seqs"):
        s.check_fits(2, 2, 3)
    with pytest.raises(ValueError):
        s.check_fits(0, 2, 1)


def test_add_request_rejects_without_side_effects() -> None:
    h = Harness(num_blocks=4, block_size=4, max_num_seqs=2, max_num_batched_tokens=8, max_model_len=20)
    h.add(*make_group("x", [1], 2, n=2))

    def rejected(leader: Request) -> None:
        before = (dict(h.sched.requests), list(h.sched.waiting))
        with pytest.raises(ValueError):
            h.sched.add_request(leader)
        assert (dict(h.sched.requests), list(h.sched.waiting)) == before

    rejected(make_group("big", [1] * 15, 6)[0])  # beyond max_model_len
    rejected(make_group("wide", [1], 2, n=3)[0])  # more samples than seats
    rejected(make_group("x", [1], 2)[0])  # leader id in use
    rejected(make_group("x#1", [1], 2)[0])  # a pending child's id
    leader, _ = make_group("y", [1], 2, n=2)
    leader.pending_children[0].request_id = "x"  # a child clashing with a live request
    rejected(leader)
    leader, _ = make_group("z", [1], 2, n=2)
    leader.pending_children[0].request_id = "z"  # a group clashing with itself
    rejected(leader)
    h.drain(max_steps=20)
    h.add(*make_group("x", [3], 2))  # a finished request's id is free again
    h.drain(max_steps=40)


# -- ending requests from outside ------------------------------------------------


def test_finish_requests_everywhere() -> None:
    h = Harness(num_blocks=12, block_size=2, max_num_seqs=6, max_num_batched_tokens=6, keep_outputs=True)
    h.add(*make_group("run", [1] * 8, 6))  # mid-prefill after one step
    h.add(*make_group("grp", [2, 3, 4, 5, 6, 7, 8, 9, 1], 6, n=3))
    h.add(*make_group("wait", [5], 3))
    h.add(*make_group("wgrp", [6], 3, n=2))
    out = h.step()
    assert [r.request_id for r in out.requests] == ["run"]
    run = h.members["run"]
    assert run.status == RequestStatus.RUNNING and 0 < run.num_computed_tokens < 8

    # A waiting request and a pending child of a waiting leader.
    h.finish(["wait", "wgrp#1"])
    assert h.members["wait"].status == RequestStatus.FINISHED_ABORTED
    assert h.members["wgrp"].pending_children == [] and h.members["wgrp"].num_seats == 1
    # A running request, mid-prefill: its blocks go back.
    free_before = h.kv.pool.num_free
    h.finish(["run"], RequestStatus.FINISHED_STOPPED)
    assert h.kv.pool.num_free == free_before + h.kv.blocks_for(6)
    assert run.status == RequestStatus.FINISHED_STOPPED and run.block_ids == []
    # Unknown and already finished ids are ignored.
    h.finish(["nope", "run", "wait"])

    h.step()  # "grp" is admitted and partly prefilled; its children are still pending
    grp = h.members["grp"]
    assert grp.status == RequestStatus.RUNNING
    assert [c.request_id for c in grp.pending_children] == ["grp#1", "grp#2"]
    h.finish(["grp#2"])  # a pending child of a running leader
    assert [c.request_id for c in grp.pending_children] == ["grp#1"]
    while "grp#1" not in [r.request_id for r in h.sched.running]:
        h.step()
    h.finish(["grp"])  # the leader after forking: its child keeps the shared blocks
    assert h.members["grp#1"].status == RequestStatus.RUNNING
    assert all(h.kv.pool.refcount(b) == 1 for b in h.members["grp#1"].block_ids)
    h.drain(max_steps=100)
    for rid in ("wait", "wgrp#1", "grp#2", "grp"):
        assert h.members[rid].status == RequestStatus.FINISHED_ABORTED
    got = outputs(h)
    want = expected_outputs(h)
    for rid, toks in got.items():
        assert toks == want[rid][: len(toks)]
    assert got["grp#1"] == want["grp#1"] and got["wgrp"] == want["wgrp"]
    assert got["grp#2"] == [] and got["wgrp#1"] == []
    # Every id was handed to the runner as finished exactly once (checked by check_end too).
    reported = [rid for o in h.outputs for rid in o.finished_ids]
    assert len(reported) == len(set(reported))


def test_finish_leader_with_pending_children_finishes_them() -> None:
    h = Harness(num_blocks=12, block_size=2, max_num_seqs=6, max_num_batched_tokens=2)
    h.add(*make_group("g", [1, 2, 3, 4, 5], 4, n=3))
    h.add(*make_group("w", [1, 2], 4, n=2))
    h.step()  # g mid-prefill, pending children; w waiting with its pending child
    g, w = h.members["g"], h.members["w"]
    assert g.status == RequestStatus.RUNNING and len(g.pending_children) == 2
    assert w.status == RequestStatus.WAITING and len(w.pending_children) == 1
    h.finish(["g", "w"])
    for rid in ("g", "g#1", "g#2", "w", "w#1"):
        assert h.members[rid].status == RequestStatus.FINISHED_ABORTED
    assert h.kv.pool.num_free == h.kv.num_blocks
    assert not h.sched.has_unfinished()
    out = h.step()
    assert sorted(out.finished_ids) == ["g", "g#1", "g#2", "w", "w#1"]
    h.check_end()


def test_finish_preempted_request() -> None:
    h = Harness(num_blocks=4, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    for k in range(4):
        h.add(*make_group(f"r{k}", [k] * 4, max_tokens=12))
    h.step()
    out = h.step()
    assert [r.request_id for r in out.preempted] == ["r3", "r2"]
    h.finish(["r3"])
    assert h.members["r3"].status == RequestStatus.FINISHED_ABORTED
    assert [r.request_id for r in h.sched.waiting] == ["r2"]
    h.drain(max_steps=200)
    assert outputs(h)["r3"] == expected_outputs(h)["r3"][:1]
