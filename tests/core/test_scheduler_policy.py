"""Scheduling policies with a fake clock: starvation bound, priority preemption, LPM order, tenants.

Every scenario runs through the checking harness of tests/scheduler_harness.py (queues, block accounting,
victim rules, KV reads), and, where it runs to the end, checks the tokens against a reference computed
without a scheduler. The clock advances one second per step.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from scheduler_harness import VOCAB, GroupSpec, Harness, Workload, make_group, outputs, reference_output

from tandem.core.policy import SchedulingConfig, TenantQuota
from tandem.core.request import Request, RequestStatus


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def policy_harness(
    num_blocks: int,
    block_size: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    config: SchedulingConfig,
    **kwargs,
) -> tuple[Harness, FakeClock]:
    clock = FakeClock()
    h = Harness(
        num_blocks,
        block_size,
        max_num_seqs,
        max_num_batched_tokens,
        kwargs.pop("max_model_len", 128),
        config=config,
        clock=clock,
        **kwargs,
    )
    return h, clock


def add(h: Harness, clock: FakeClock, rid: str, prompt: list[int], max_tokens: int, **fields) -> Request:
    leader, members = make_group(rid, prompt, max_tokens, arrival_time=clock(), **fields)
    h.add(leader, members)
    return leader


def step(h: Harness, clock: FakeClock):
    out = h.step()
    clock.t += 1.0
    return out


def drain(h: Harness, clock: FakeClock, max_steps: int) -> None:
    while h.sched.has_unfinished():
        assert h.num_steps < max_steps, "no progress"
        step(h, clock)
    h.check_end()


def expected(h: Harness) -> dict[str, list[int]]:
    return {
        rid: reference_output(
            r.prompt_token_ids, r.sampling, r.max_tokens, r.eos_token_ids, r.sample_index, h.max_model_len
        )[0]
        for rid, r in h.members.items()
    }


# -- (a) the starvation bound ------------------------------------------------

HOT_PREFIX = list(range(100, 132))  # 32 tokens: 8 blocks of 4
HOT_MAX_TOKENS = 4
COLD_ARRIVAL = 5


def run_favoured_stream(policy: str, timeout: float, num_steps: int) -> tuple[Harness, Request]:
    """Two seats; before every step the stream tops the queue up to two favoured requests (sharing a
    cached 32-token prefix, priority 0), each holding a seat for HOT_MAX_TOKENS steps. At step
    COLD_ARRIVAL a cold request arrives (no cached prefix, priority 10): the policy always prefers the
    favoured requests, of which some are always waiting."""
    config = SchedulingConfig(policy=policy, starvation_timeout_s=timeout)
    h, clock = policy_harness(300, 4, 2, 256, config, enable_prefix_caching=policy == "lpm")
    cold = None
    k = 0
    for s in range(num_steps):
        while sum(r.request_id.startswith("hot") for r in h.sched.waiting) < 2:
            add(h, clock, f"hot{k}", [*HOT_PREFIX, k % VOCAB, k // VOCAB], HOT_MAX_TOKENS, priority=0)
            k += 1
        if s == COLD_ARRIVAL:
            cold = add(h, clock, "cold", list(range(200, 220)), 6, priority=10)
        step(h, clock)
    assert cold is not None
    return h, cold


@pytest.mark.parametrize("policy", ["lpm", "priority"])
def test_starvation_bound_admits_the_cold_request(policy: str) -> None:
    """Bound: a cold request is admitted within starvation_timeout_s plus HOT_MAX_TOKENS steps (once
    starved it heads the queue, and a seat frees within the lifetime of a favoured request). It then
    runs to the end without being preempted for the favoured traffic (it outranks that traffic now:
    preempting it would only readmit it at once, recomputing it)."""
    timeout = 20.0
    h, cold = run_favoured_stream(policy, timeout, num_steps=60)
    assert cold.first_scheduled_time is not None
    waited = cold.first_scheduled_time - cold.arrival_time
    assert timeout <= waited <= timeout + HOT_MAX_TOKENS
    assert cold.status == RequestStatus.FINISHED_LENGTH and cold.num_preemptions == 0
    assert cold.output_token_ids == expected(h)["cold"]
    if policy == "lpm":
        assert cold.num_cached_tokens == 0
        # The first two favoured requests were admitted together, before anything was cached.
        hot = {
            int(rid[3:]): r
            for rid, r in h.members.items()
            if rid.startswith("hot") and r.first_scheduled_time is not None
        }
        assert {0, 1, 2} <= set(hot)
        assert all(r.num_cached_tokens == (32 if k >= 2 else 0) for k, r in hot.items())


@pytest.mark.parametrize("policy", ["lpm", "priority"])
def test_without_the_bound_the_cold_request_starves(policy: str) -> None:
    """The same stream with an effectively infinite timeout: the cold request is never admitted in
    150 steps while the favoured stream flows (the mechanism above is what admits it)."""
    h, cold = run_favoured_stream(policy, 1e9, num_steps=150)
    assert cold.first_scheduled_time is None and cold.status == RequestStatus.WAITING
    finished = [r for rid, r in h.members.items() if rid.startswith("hot") and r.is_finished]
    assert len(finished) >= 60
    # Favoured requests arriving after the cold one overtook it.
    assert sum(r.arrival_time > cold.arrival_time for r in finished) >= 55


# -- (b) priority preemption ---------------------------------------------------


def test_priority_preemption_for_seats() -> None:
    config = SchedulingConfig(policy="priority", starvation_timeout_s=1e9)
    h, clock = policy_harness(200, 4, 3, 256, config, keep_outputs=True)
    for rid, prio in (("p5", 5), ("p0", 0), ("p9", 9)):
        add(h, clock, rid, [prio, 1, 2], 12, priority=prio)
    step(h, clock)
    assert sorted(r.request_id for r in h.sched.running) == ["p0", "p5", "p9"]

    add(h, clock, "p3", [3, 3], 12, priority=3)
    out = step(h, clock)
    assert [r.request_id for r in out.preempted] == ["p9"]  # the lowest priority goes, nobody else
    assert "p3" in [r.request_id for r in out.requests]
    assert sorted(r.request_id for r in h.sched.running) == ["p0", "p3", "p5"]

    add(h, clock, "p7", [7, 7], 12, priority=7)  # lower priority than everything running: it waits
    out = step(h, clock)
    assert out.preempted == [] and h.members["p7"].status == RequestStatus.WAITING

    add(h, clock, "p0b", [0, 0], 12, priority=0)  # equal to p0, higher than p3 and p5: p5 goes
    out = step(h, clock)
    assert [r.request_id for r in out.preempted] == ["p5"]
    assert sorted(r.request_id for r in h.sched.running) == ["p0", "p0b", "p3"]

    add(h, clock, "p0c", [0, 1], 12, priority=0)  # p3 goes
    out = step(h, clock)
    assert [r.request_id for r in out.preempted] == ["p3"]
    add(h, clock, "p0d", [0, 2], 12, priority=0)  # every running request has priority 0: none goes
    out = step(h, clock)
    assert out.preempted == [] and h.members["p0d"].status == RequestStatus.WAITING
    drain(h, clock, max_steps=200)
    assert outputs(h) == expected(h)
    victims = [(v.priority, c.priority) for v, c in h.priority_victims]
    assert victims == [(9, 3), (5, 0), (3, 0)]


def test_priority_preemption_for_blocks() -> None:
    """Blocks short (seats plenty): the high-priority request preempts the lowest-priority requests, as
    few as it needs, and is admitted in the same step."""
    config = SchedulingConfig(policy="priority", starvation_timeout_s=1e9)
    h, clock = policy_harness(20, 4, 8, 256, config)
    add(h, clock, "low5", [5] * 24, 8, priority=5)  # 6 blocks for the prompt
    add(h, clock, "low9", [9] * 24, 8, priority=9)
    add(h, clock, "low7", [7] * 20, 8, priority=7)  # 5 blocks
    step(h, clock)
    assert h.kv.num_available == 20 - 17
    add(h, clock, "high", [1] * 20, 4, priority=0)  # 5 blocks: one victim is enough
    out = step(h, clock)
    assert [r.request_id for r in out.preempted] == ["low9"]
    assert "high" in [r.request_id for r in out.requests]
    # 10 blocks, 2 available: low7 (6 blocks) is the only request it may preempt, and that is not
    # enough. Preempting it would throw its work away for nothing: nobody goes, mid waits.
    add(h, clock, "mid", [2] * 40, 4, priority=6)
    out = step(h, clock)
    assert out.preempted == [] and h.members["mid"].status == RequestStatus.WAITING
    drain(h, clock, max_steps=300)
    assert h.members["low5"].num_preemptions == 0 and h.members["high"].num_preemptions == 0
    assert outputs(h) == expected(h)
    assert all(v.priority > c.priority for v, c in h.priority_victims)


def test_priority_preemption_counts_idle_cached_prefix_it_would_lock() -> None:
    """With prefix caching, the high-priority request's cached prefix is idle in the cache: it counts as
    available, but matching locks it, so it cannot also serve for the new blocks. The request must
    still preempt what it needs and be admitted at once, not wait for the low-priority one to end."""
    config = SchedulingConfig(policy="priority", starvation_timeout_s=1e9)
    h, clock = policy_harness(12, 4, 4, 256, config, enable_prefix_caching=True)
    prefix = list(range(1, 17))  # 4 blocks
    add(h, clock, "warm", prefix, 1, priority=0)
    step(h, clock)
    assert h.kv.cache is not None and h.kv.cache.num_unlocked_blocks == 4
    add(h, clock, "low", [9] * 28, 4, priority=9)  # 7 blocks: one free block left
    step(h, clock)
    assert h.kv.pool.num_free == 1
    high = add(h, clock, "high", [*prefix, 0, 0, 0, 0, 0, 0, 0, 0], 2, priority=0)  # 4 cached + 2 new blocks
    out = step(h, clock)
    assert [r.request_id for r in out.preempted] == ["low"]
    assert high.status == RequestStatus.RUNNING and high.num_cached_tokens == 16
    drain(h, clock, max_steps=100)
    assert outputs(h) == expected(h)


# -- (c) LPM order ---------------------------------------------------------------


def test_lpm_orders_the_waiting_queue_by_cached_prefix() -> None:
    config = SchedulingConfig(policy="lpm", starvation_timeout_s=1e9)
    h, clock = policy_harness(200, 4, 1, 256, config, enable_prefix_caching=True)
    long_p, mid_p, short_p = list(range(100, 124)), list(range(200, 212)), list(range(300, 304))
    for rid, p in (("w-long", long_p), ("w-mid", mid_p), ("w-short", short_p)):
        add(h, clock, rid, [*p, 1], 1)
        drain(h, clock, max_steps=50)
    add(h, clock, "blocker", [7, 7, 7], 6)  # holds the only seat while the queue fills
    step(h, clock)
    arrivals = [
        ("none1", [400, 401, 402, 403, 404]),
        ("short", [*short_p, 500, 501]),
        ("long1", [*long_p, 600]),
        ("mid", [*mid_p, 700, 701]),
        ("none2", [410, 411, 412, 413, 414]),
        ("long2", [*long_p[:22], 800, 801]),  # diverges mid-block: 20 tokens match
    ]
    for rid, prompt in arrivals:
        add(h, clock, rid, prompt, 1)
        clock.t += 0.1
    lens = {r.request_id: h.kv.match_len(r) for r in h.sched.waiting}
    assert lens == {"none1": 0, "short": 4, "long1": 24, "mid": 12, "none2": 0, "long2": 20}
    want = ["long1", "long2", "mid", "short", "none1", "none2"]
    assert [r.request_id for r in h.sched._admission_order(clock())] == want
    drain(h, clock, max_steps=100)
    admitted = [rid for rid, _, _ in h.admissions if rid in lens]
    assert admitted == want
    assert [h.members[rid].num_cached_tokens for rid in want] == [24, 20, 12, 4, 0, 0]


def test_lpm_falls_back_to_arrival_order_beyond_lpm_max_queue() -> None:
    config = SchedulingConfig(policy="lpm", starvation_timeout_s=1e9, lpm_max_queue=3)
    h, clock = policy_harness(200, 4, 1, 256, config, enable_prefix_caching=True)
    add(h, clock, "warm", [*range(100, 116), 1], 1)
    drain(h, clock, max_steps=10)
    for k in range(4):
        add(h, clock, f"q{k}", [*range(100, 100 + 4 * k), 900 + k], 1)
        clock.t += 0.1
    assert [r.request_id for r in h.sched._admission_order(clock())] == ["q0", "q1", "q2", "q3"]
    h.finish(["q0"])
    assert [r.request_id for r in h.sched._admission_order(clock())] == ["q3", "q2", "q1"]


# -- (d) tenants -------------------------------------------------------------------


def flood(weights: dict[str, float], timeout: float, late_b: bool) -> tuple[Harness, FakeClock, Counter]:
    """Tenant A floods 50 requests at step 0; B floods 50 too (at step 0), or sends 3 at step 40 (when,
    with a 30 s timeout, all of A's backlog has waited past it). Four seats, each request holds one for
    9 steps. Returns the tokens computed per tenant per step while both had requests waiting."""
    tenants = {t: TenantQuota(weight=w) for t, w in weights.items()}
    config = SchedulingConfig(policy="fcfs", starvation_timeout_s=timeout, tenants=tenants)
    h, clock = policy_harness(400, 4, 4, 256, config)
    for k in range(50):
        add(h, clock, f"A{k}", [k % VOCAB] * 8, 8, tenant="A")
        if not late_b:
            add(h, clock, f"B{k}", [(k + 3) % VOCAB] * 8, 8, tenant="B")
    served: Counter = Counter()
    while h.sched.has_unfinished() or h.num_steps <= 40:
        if late_b and h.num_steps == 40:
            for k in range(3):
                add(h, clock, f"B{k}", [k] * 8, 8, tenant="B")
        both = {r.tenant for r in h.sched.waiting} == {"A", "B"}
        out = step(h, clock)
        if both:
            for r, n in zip(out.requests, out.num_tokens):
                served[r.tenant] += n
        assert h.num_steps < 1000
    h.check_end()
    return h, clock, served


@pytest.mark.parametrize("timeout", [1e9, 30.0])
def test_late_tenant_is_not_queued_behind_a_flood(timeout: float) -> None:
    """B's requests are admitted as soon as seats free (within a request's lifetime, 9 steps), not
    after A's 50-request backlog (about 100 steps), even when that backlog is starved."""
    h, _, _ = flood({"A": 1.0, "B": 1.0}, timeout, late_b=True)
    for k in range(3):
        b = h.members[f"B{k}"]
        assert b.first_scheduled_time is not None
        assert b.first_scheduled_time - b.arrival_time <= 9
    last_a = max(h.members[f"A{k}"].first_scheduled_time for k in range(50))
    assert last_a > 90
    assert outputs(h) == expected(h)


@pytest.mark.parametrize(("wa", "wb"), [(3.0, 1.0), (1.0, 1.0), (1.0, 3.0)])
def test_weights_share_service(wa: float, wb: float) -> None:
    h, _, served = flood({"A": wa, "B": wb}, 1e9, late_b=False)
    ratio = served["A"] / served["B"]
    assert wa / wb * 0.8 <= ratio <= wa / wb * 1.25, served
    assert outputs(h) == expected(h)


QUOTAS = {
    "A": TenantQuota(max_running=2),
    "B": TenantQuota(weight=2.0, max_blocks=12),
    "C": TenantQuota(max_running=3, max_blocks=20),
}


@st.composite
def tenant_workloads(draw) -> tuple[Workload, str]:
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    max_num_seqs = draw(st.integers(2, 6))
    groups = []
    for k in range(draw(st.integers(2, 10))):
        prompt = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24))
        max_tokens = draw(st.integers(1, 10))
        groups.append(
            GroupSpec(
                rid=f"g{k}",
                prompt=tuple(prompt),
                max_tokens=max_tokens,
                n=draw(st.sampled_from([1, 1, 2, 3]).map(lambda n: min(n, max_num_seqs))),
                mode="ignore_eos",
                stop=0,
                min_tokens=0,
                arrival=draw(st.integers(0, 10)),
                priority=draw(st.integers(0, 3)),
                tenant=draw(st.sampled_from(["A", "B", "C", None])),
            )
        )
    w = Workload(
        block_size=block_size,
        max_num_batched_tokens=draw(st.integers(1, 24)),
        max_num_seqs=max_num_seqs,
        groups=tuple(groups),
        extra_blocks=draw(st.integers(0, 6)),
        aborts=(),
    )
    return w, draw(st.sampled_from(["fcfs", "priority", "lpm"]))


@settings(max_examples=60, deadline=None)
@given(wp=tenant_workloads(), timeout=st.sampled_from([3.0, 1e9]), caching=st.booleans())
def test_tenant_quotas_are_never_exceeded(wp: tuple[Workload, str], timeout: float, caching: bool) -> None:
    """Random tenants, priorities, policies and a tight cache: after every step each tenant's running
    sequences stay within max_running, and the blocks they may grow to (blocks_for(prompt +
    max_tokens) per sequence) within max_blocks. A request that could never fit its tenant's quota is
    refused when added. Everything else finishes with the reference tokens."""
    w, policy = wp
    config = SchedulingConfig(policy=policy, starvation_timeout_s=timeout, tenants=QUOTAS)
    num_blocks = max(w.tight_blocks, 12)
    h, clock = policy_harness(
        num_blocks,
        w.block_size,
        w.max_num_seqs,
        w.max_num_batched_tokens,
        config,
        max_model_len=64,
        enable_prefix_caching=caching,
    )
    refused = set()
    last = max(g.arrival for g in w.groups)
    while h.num_steps <= last or h.sched.has_unfinished():
        for g in w.groups:
            if g.arrival == h.num_steps:
                leader, members = g.build(arrival_time=clock())
                quota = QUOTAS.get(g.tenant or "", TenantQuota())
                blocks = g.n * h.kv.blocks_for(len(g.prompt) + g.max_tokens)
                never = (quota.max_running is not None and g.n > quota.max_running) or (
                    quota.max_blocks is not None and blocks > quota.max_blocks
                )
                if never:
                    with pytest.raises(ValueError, match="quota"):
                        h.sched.add_request(leader)
                    refused.add(g.rid)
                    continue
                h.add(leader, members)
        step(h, clock)
        seats: Counter = Counter()
        blocks_held: Counter = Counter()
        for r in h.sched.running:
            seats[r.tenant] += r.num_seats
            blocks_held[r.tenant] += r.num_seats * h.kv.blocks_for(r.num_prompt_tokens + r.max_tokens)
        for t, q in QUOTAS.items():
            if q.max_running is not None:
                assert seats[t] <= q.max_running, f"tenant {t} runs {seats[t]} sequences"
            if q.max_blocks is not None:
                assert blocks_held[t] <= q.max_blocks, f"tenant {t} may hold {blocks_held[t]} blocks"
        assert h.num_steps < 2000, "no progress"
    h.check_end()
    want = expected(h)
    for rid, r in h.members.items():
        assert r.output_token_ids == want[rid]
    if refused:
        event("a request was refused for its tenant quota")
    if h.priority_victims:
        event("priority preemption")
    event(f"policy {policy}")
