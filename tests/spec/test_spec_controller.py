"""The adaptive speculation controller: cost model, per-request draft lengths, and the measured gate."""

from __future__ import annotations

import itertools

from tandem.core.step_io import DraftPass
from tandem.spec.config import AdaptiveConfig
from tandem.spec.controller import AdaptiveSpeculation, Plan
from tandem.spec.cost import LinearCost
from tandem.spec.gate import GateChoice, SpecGate


def pin_gate(ctl: AdaptiveSpeculation, choice: GateChoice) -> None:
    """The gate answers `choice` whatever it measured; it promises no repeats, so no plan is
    leased (a lease would skip the pinned answer)."""
    ctl.gate.choose = lambda n: choice  # type: ignore[method-assign]
    ctl.gate.repeats = lambda n, choice: 0  # type: ignore[method-assign]


def test_linear_cost_recovers_a_line():
    c = LinearCost(decay=1.0)
    for t in range(1, 50):
        c.observe(t, 0.01 + 0.002 * t)
    a, b = c.coefficients()
    assert abs(a - 0.01) < 1e-9 and abs(b - 0.002) < 1e-9


def test_a_measured_shape_is_only_rescaled_online():
    """Seeded with a line measured over a wide range, noisy online samples over a narrow one (a
    single request's steps) move the level, not the slope."""
    c = LinearCost()
    c.set_shape([(1, 0.003), (64, 0.0036), (320, 0.006)])
    a0, b0 = c.coefficients()
    assert abs(b0 - 0.0000094) < 2e-6
    for i in range(40):  # the machine now runs 20% slower, with noise, at 1 or 2 tokens a step
        c.observe(1 + i % 2, (a0 + b0 * (1 + i % 2)) * 1.2 * (1.1 if i % 4 == 1 else 1.0))
    a, b = c.coefficients()
    assert 1.2 < a / a0 < 1.26 and abs(b / b0 - a / a0) < 1e-9
    free = LinearCost()  # the same samples unseeded: the slope is the noise
    for i in range(40):
        free.observe(1 + i % 2, (a0 + b0 * (1 + i % 2)) * 1.2 * (1.1 if i % 4 == 1 else 1.0))
    assert free.coefficients()[1] > 10 * b0


def test_plan_speculates_when_fixed_cost_dominates_and_not_when_tokens_cost():
    ctl = AdaptiveSpeculation(max_k=4, config=AdaptiveConfig(warmup_steps=0))
    ids = [f"r{i}" for i in range(64)]
    for rid in ids:
        ctl.observe_acceptance(rid, 4, 2)  # alpha about 0.5
    for t in (64, 128, 256):
        ctl.observe_step(t, 0.020 + 0.00001 * t)  # fixed cost dominates
    ks = ctl.plan(ids[:1], other_tokens=0, draft_passes_cost=False).num_draft
    assert ks["r0"] == 4
    # A step that also carries prompt tokens never drafts, whatever the model says.
    assert ctl.plan(ids[:1], other_tokens=5, draft_passes_cost=False).num_draft == {}
    heavy = AdaptiveSpeculation(max_k=4, config=AdaptiveConfig(warmup_steps=0))
    for t in (64, 128, 256):
        heavy.observe_step(t, 0.001 + 0.001 * t)  # every token costs as much as the fixed part
    ks = heavy.plan(ids, other_tokens=0, draft_passes_cost=False).num_draft
    assert sum(ks.values()) == 0


def test_plan_prices_draft_passes_as_a_fixed_cost_shared_by_the_batch():
    """A draft pass costs about the same for one request as for eight: one draft token alone never
    pays for it, eight requests drafting together do. The plan must find that, and must still
    draft nothing where even the best plan loses."""
    ids = [f"r{i}" for i in range(8)]

    def controller(pass_fixed: float) -> AdaptiveSpeculation:
        ctl = AdaptiveSpeculation(max_k=4)
        ctl.seed(
            [(t, 0.003 + 0.00001 * t) for t in (1, 5, 8, 40)],  # 3 ms a step, 10 us a token
            [(n, pass_fixed + 0.00005 * n) for n in (1, 8)],  # a pass: fixed + 50 us a request
        )
        for rid in ids:
            ctl.observe_acceptance(rid, 4, 4)
            ctl.observe_acceptance(rid, 4, 4)  # alpha about 0.9
        return ctl

    ks = controller(0.001).plan(ids, other_tokens=0, draft_passes_cost=True).num_draft
    # One request's first draft token: 8.9 expected tokens in 3.09 + 1.05 ms, below the plain
    # 8 in 3.08 ms; all eight drafting one token pays, and a second pass pays again.
    assert all(k >= 2 for k in ks.values()), ks
    assert len(set(ks.values())) == 1  # every request drafts as many tokens as there are passes
    assert sum(controller(0.010).plan(ids, other_tokens=0, draft_passes_cost=True).num_draft.values()) == 0


def test_seeded_costs_price_the_first_step():
    """Without measured costs the plan drafts max_k for its first steps; seeded, it plans from the
    first step, and a draft too slow to pay is not used even once."""
    blind = AdaptiveSpeculation(max_k=4)
    assert blind.plan(["a"], other_tokens=0, draft_passes_cost=True).num_draft == {"a": 4}
    ctl = AdaptiveSpeculation(max_k=4)
    ctl.seed([(1, 0.003), (5, 0.0031)], [(1, 0.01)])  # a draft pass costs three steps
    assert ctl.seeded and ctl.step_cost.shape is not None and ctl.draft_cost.shape is not None
    assert sum(ctl.plan(["a"], other_tokens=0, draft_passes_cost=True).num_draft.values()) == 0


def test_gate_samples_are_taken_at_the_load_time_machine_speed():
    """Steps run while the machine is 25% slower are filed as if at the seeded speed, so the two
    modes, measured at different moments, compare like with like."""
    ctl = AdaptiveSpeculation(max_k=4)
    ctl.seed([(1, 0.004), (5, 0.004)], [])
    for _ in range(30):
        ctl.observe_step(1, 0.005)
    assert abs(ctl.step_cost.scale - 1.25) < 1e-9
    plan = ctl.plan(["a"], other_tokens=0, draft_passes_cost=False)
    ctl.observe_outcome(plan, 3, 0.010)
    tokens, seconds, samples = ctl.gate._stats[1][True]
    assert tokens == 3 and abs(seconds - 0.008) < 1e-12 and samples == 1


def test_speculation_overhead_is_learned_from_drafting_steps():
    """With a measured shape, drafting steps teach what speculating costs beyond the shape (their
    time does not rescale it), and the plan charges that once per drafting step: a request whose
    drafts would pay at zero overhead does not draft when the overhead eats the gain (priced at the
    mean acceptance: no optimism for exploring)."""
    ctl = AdaptiveSpeculation(max_k=4, config=AdaptiveConfig(explore_z=0.0, overhead_prior_samples=0.0))
    ctl.seed([(1, 0.003), (5, 0.003)], [])
    ctl.observe_acceptance("a", 4, 0)  # alpha 1/3: drafting pays only while it costs nothing
    assert sum(ctl.plan(["a"], other_tokens=0, draft_passes_cost=False).num_draft.values()) > 0
    for _ in range(60):
        ctl.observe_step(5, 0.0045, drafted=True)  # 1.5 ms more than the shape says
        ctl.observe_step(1, 0.003)
    assert abs(ctl.spec_overhead - 0.0015) < 1e-5 and abs(ctl.step_cost.scale - 1.0) < 1e-9
    assert sum(ctl.plan(["a"], other_tokens=0, draft_passes_cost=False).num_draft.values()) == 0


def test_gate_runs_the_measured_better_mode_and_explores():
    gate = SpecGate(AdaptiveConfig(explore_every=10, min_samples=2))
    assert gate.choose(64) == GateChoice(on=True, exploring=True)  # no data on "on" yet: try it
    for _ in range(3):
        gate.observe(64, True, 64, 0.2)  # 320 tok/s with speculation
    assert gate.choose(64).on is False  # no data on "off" yet: try it
    for _ in range(3):
        gate.observe(64, False, 64, 0.1)  # 640 tok/s without
    # "on" runs at half the rate: an exploring step loses one step's worth, so at a 1% budget the
    # gate explores for min_samples (2) steps once per 200 steps.
    assert gate.explore_interval(320.0, 640.0) == 200
    choices = [gate.choose(64).on for _ in range(400)]
    assert choices.count(True) == 4  # mostly off, still exploring
    first = choices.index(True)
    assert choices[first : first + 2] == [True, True]  # an exploration is a burst of min_samples steps
    assert gate.preferred(64) is False
    # Another batch size is its own bucket.
    assert gate.choose(1).on is True
    assert gate.preferred(2) is True  # untried


def test_gate_rechecks_close_calls_often_and_clear_losers_rarely():
    gate = SpecGate(AdaptiveConfig(explore_every=8, explore_cost=0.01, max_explore=256))
    assert gate.explore_interval(100.0, 99.5) == 8  # within 1%: the floor
    assert gate.explore_interval(100.0, 90.0) == 34  # 3 steps lose 1/3 of a step: every 34
    assert gate.explore_interval(10.0, 100.0) == 256  # the cap


def test_plan_returns_nothing_when_the_gate_is_off():
    ctl = AdaptiveSpeculation(max_k=4, config=AdaptiveConfig(warmup_steps=0))
    for _ in range(3):
        plan = ctl.plan(["a", "b"], other_tokens=0, draft_passes_cost=False)
        ctl.observe_outcome(plan, 2, 1.0)  # speculation on: 2 tok/s
    for _ in range(3):
        plan = ctl.plan(["a", "b"], other_tokens=0, draft_passes_cost=False)
        ctl.observe_outcome(plan, 2, 0.1)
    got = [ctl.plan(["a", "b"], other_tokens=0, draft_passes_cost=False).num_draft for _ in range(5)]
    assert {} in got
    # A step with prompt chunks in it follows the bucket's choice (off) without exploring.
    assert all(ctl.plan(["a", "b"], other_tokens=7, draft_passes_cost=False) == Plan({}) for _ in range(50))


def test_on_steps_without_drafts_count_as_off():
    """An "on" step in which nothing was drafted ran as an "off" step: the gate files it there."""
    ctl = AdaptiveSpeculation(max_k=4, config=AdaptiveConfig(warmup_steps=0))
    plan = ctl.plan(["a"], other_tokens=0, draft_passes_cost=False)
    assert (plan.num_decoding, plan.gate_on) == (1, True)  # nothing measured yet: "on" is tried first
    ctl.observe_outcome(plan, 1, 0.01, drafted=False)
    gate = ctl.gate
    assert gate._stats[1][False][2] == 1 and True not in gate._stats[1]
    plan = ctl.plan(["a"], other_tokens=0, draft_passes_cost=False)
    ctl.observe_outcome(plan, 3, 0.01, drafted=True)
    assert gate._stats[1][True][2] == 1


def test_steps_that_also_computed_prompts_are_no_sample():
    """A planned pure-decode step that ended up computing prompt tokens as well is not filed."""
    ctl = AdaptiveSpeculation(max_k=4, config=AdaptiveConfig(warmup_steps=0))
    plan = ctl.plan(["a"], other_tokens=0, draft_passes_cost=False)
    ctl.observe_outcome(plan, 3, 0.5, drafted=True, pure=False)
    assert ctl.gate._stats == {}
    plan = ctl.plan(["a"], other_tokens=0, draft_passes_cost=False)
    ctl.observe_outcome(plan, 3, 0.01, drafted=True)
    assert ctl.gate._stats[1][True][2] == 1


def test_unmeasured_bucket_borrows_its_neighbours_verdict():
    gate = SpecGate(AdaptiveConfig(min_samples=2, max_explore=64))
    for _ in range(2):
        gate.observe(8, True, 8, 0.2)  # bucket of 8: speculation loses
        gate.observe(8, False, 8, 0.1)
    # A larger batch starts off (off measured smaller) and samples "on" only on the slow schedule.
    choices = []
    for _ in range(128):
        on = gate.choose(32).on
        gate.observe(32, on, 32, 0.4 if on else 0.2)
        choices.append(on)
    assert choices[:2] == [False, False]
    # One burst of min_samples "on" steps at step 64; the next exploration starts at step 128.
    assert choices[63:65] == [True, True] and choices.count(True) == 3
    assert gate.preferred(32) is False
    # A smaller batch is not covered by an "off" verdict from above: it tries "on" first.
    assert gate.choose(2).on is True
    for _ in range(2):
        gate.observe(1, True, 10, 0.1)  # a single stream gains
        gate.observe(1, False, 5, 0.1)
    # Between "on" at 1 and "off" at 8 neither verdict carries over: untried, so "on" first.
    assert gate.preferred(4) is True
    assert gate.preferred(64) is False  # off measured at 8 and 32
    gate2 = SpecGate(AdaptiveConfig(min_samples=2))
    for _ in range(2):
        gate2.observe(16, True, 20, 0.1)
        gate2.observe(16, False, 10, 0.1)
    assert gate2.choose(4).on is True and gate2.preferred(4) is True  # on measured larger: on here


def test_draft_catch_up_is_spread_over_steps() -> None:
    """A draft that missed whole prompts catches up a budget's worth of requests per step."""
    from scheduler_harness import make_group

    from tandem.spec.config import SpeculativeConfig
    from tandem.spec.planner import SpecPlanner

    config = SpeculativeConfig(method="draft_model", num_speculative_tokens=3, model="d")
    budget = config.adaptive_config.catch_up_tokens_per_step
    planner = SpecPlanner(config)
    reqs = []
    for i in range(3):
        r, _ = make_group(f"r{i}", list(range(budget + 1)), max_tokens=50)
        r.token_ids.append(7)  # prompt computed, one sampled token: decoding, draft never fed
        r.num_computed_tokens = r.num_prompt_tokens
        reqs.append(r)
    first = planner.plan(reqs, other_tokens=0, max_model_len=1000).num_draft
    assert list(first) == ["r0"]  # one whole prompt fits the budget, a second would not
    planner.observe(reqs[0], first["r0"], 0)
    reqs[0].num_computed_tokens += 1
    reqs[0].token_ids.append(8)
    second = planner.plan(reqs, other_tokens=0, max_model_len=1000).num_draft
    assert sorted(second) == ["r0", "r1"]  # r0 is caught up (one token behind); r1 takes the budget


def test_a_draft_further_behind_than_the_budget_still_catches_up() -> None:
    """A request whose prompt alone exceeds the catch-up budget still drafts (the closest such
    request, one per step): a draft catches up only by drafting, so skipping it would be for good."""
    from scheduler_harness import make_group

    from tandem.spec.config import SpeculativeConfig
    from tandem.spec.planner import SpecPlanner

    config = SpeculativeConfig(method="draft_model", num_speculative_tokens=3, model="d")
    budget = config.adaptive_config.catch_up_tokens_per_step
    planner = SpecPlanner(config)
    reqs = []
    for i, length in enumerate((3 * budget, 2 * budget)):
        r, _ = make_group(f"r{i}", list(range(length)), max_tokens=50)
        r.token_ids.append(7)
        r.num_computed_tokens = r.num_prompt_tokens
        reqs.append(r)
    assert list(planner.plan(reqs, other_tokens=0, max_model_len=1000).num_draft) == ["r1"]  # the shorter one
    # Up to a bound on what one step may add for everyone in it (the engine's step budget).
    bounded = SpecPlanner(config, max_catch_up=2 * budget - 8)  # r1 is 2 * budget - 1 behind
    assert bounded.plan(reqs, other_tokens=0, max_model_len=1000).num_draft == {}


def test_a_new_request_drafts_to_measure_its_acceptance():
    """Priced at the prior's mean (1/2), a draft pass here only breaks even, so a new request would
    never draft and never learn that its drafts are accepted. The plan prices drafts at an
    optimistic acceptance while evidence is thin: a new request drafts; one whose drafts keep being
    rejected stops; once its history has faded, it tries again."""
    ids = ["a"]

    def controller(**kwargs: float) -> AdaptiveSpeculation:
        ctl = AdaptiveSpeculation(max_k=4, config=AdaptiveConfig(**kwargs))
        ctl.seed([(1, 0.004), (5, 0.004)], [(1, 0.002)])  # a draft pass: half a step
        return ctl

    assert sum(controller(explore_z=0.0).plan(ids, 0, draft_passes_cost=True).num_draft.values()) == 0
    ctl = controller()  # the default optimism
    assert ctl.plan(ids, 0, draft_passes_cost=True).num_draft["a"] >= 1
    for _ in range(6):
        ctl.observe_acceptance("a", 2, 0)
    assert ctl.optimistic_alpha("a") < 0.3
    waits = 0
    while sum(ctl.plan(ids, 0, draft_passes_cost=True).num_draft.values()) == 0:
        waits += 1
        assert waits < 100, "a faded history must make the request draft again"
    assert waits > 3  # but not at once


def test_exploring_speculation_from_off_is_charged_its_switching_cost():
    """Exploring "on" from "off" first feeds a draft model what it missed: the gate counts that
    catch-up (in steps) into the exploration's cost, so it explores less often."""
    gate = SpecGate(AdaptiveConfig(explore_every=8, explore_cost=0.01, max_explore=256))
    assert gate.explore_interval(90.0, 100.0) == 34
    for _ in range(50):
        gate.observe_switch(1.0)  # a catch-up costs a whole step
    assert abs(gate.switch_steps - 1.0) < 1e-4
    assert gate.explore_interval(90.0, 100.0) == 134  # (3 * 1/9 + 1) / 1%
    assert gate.explore_interval(100.0, 90.0) == 34  # exploring "off" switches nothing on


def test_a_draft_catch_up_is_priced_over_the_requests_remaining_steps():
    """A request whose draft must first catch up on its prompt pays that (per token, paid off over
    its remaining steps) once it drafts: where drafting barely pays it does not start, where it
    clearly pays it does; and while the gate explores "on", the catch-up it budgeted is not priced
    again (else the exploration would draft nothing and measure nothing)."""

    def controller(pass_cost: float) -> AdaptiveSpeculation:
        # Priced afresh every plan: the plans below change the backlog between calls, which in a
        # run only grows while no request drafts (what a held zero verdict assumes).
        cfg = AdaptiveConfig(explore_z=0.0, zero_plan_hold_max=0)
        ctl = AdaptiveSpeculation(max_k=4, config=cfg)
        ctl.seed([(1, 0.004), (5, 0.004)], [(1, pass_cost)], feed_cost=0.0001)  # 0.1 ms a token
        for _ in range(3):
            ctl.observe_acceptance("a", 4, 2)  # alpha about 0.63
        return ctl

    def backlog() -> dict[str, float]:
        return {"a": 10.0}  # e.g. a 320-token prompt paid off over 32 steps: 1 ms a step

    cheap, dear = controller(0.0005), controller(0.002)
    for ctl in (cheap, dear):
        pin_gate(ctl, GateChoice(on=True))  # the gate has measured "on" as the better mode
    assert cheap.plan(["a"], 0, True, backlog).num_draft["a"] >= 1
    assert sum(dear.plan(["a"], 0, True, backlog).num_draft.values()) == 0
    assert dear.plan(["a"], 0, True, dict).num_draft["a"] >= 1  # caught up, the same request drafts
    exploring = controller(0.002)
    pin_gate(exploring, GateChoice(on=True, exploring=True))  # "on" chosen to be measured
    assert exploring.plan(["a"], 0, True, backlog).num_draft["a"] >= 1


def test_the_gate_pays_prompt_catch_up_as_a_running_mean():
    """A new request's prompt fed to the draft is a cost of speculating, so "on" samples pay it, but
    as a running mean per drafting step, not all in the one step the request arrived in."""
    ctl = AdaptiveSpeculation(max_k=4)
    plan = ctl.plan(["a"], other_tokens=0, draft_passes_cost=False)
    ctl.observe_outcome(plan, 3, 0.004 + 0.010, drafted=True, feed_seconds=0.010)  # a 10 ms prompt feed
    tokens, seconds, _ = ctl.gate._stats[1][True]
    assert tokens == 3 and abs(seconds - (0.004 + 0.05 * 0.010)) < 1e-12  # the step, plus 1/20 of the feed
    assert abs(ctl.feed_mean - 0.0005) < 1e-12
    ctl.observe_feed(100, 0.008)
    assert abs(ctl.feed_cost - 0.00008) < 1e-12  # the first sample sets it
    ctl.observe_feed(100, 0.010)
    assert 0.00008 < ctl.feed_cost < 0.0001


def test_a_catch_up_pass_is_split_into_switching_and_prompt_costs():
    """A draft pass that also caught drafts up costs more than a plain pass; that excess is returned
    split in proportion to the tokens missed while speculation was off (switching) and new prompts'
    tokens, and teaches the per-token catch-up cost. Plain passes teach the pass cost line."""
    ctl = AdaptiveSpeculation(max_k=4)
    ctl.seed([(1, 0.004), (5, 0.004)], [(1, 0.001), (8, 0.001)])
    assert ctl.observe_draft_pass(DraftPass(num_requests=1, seconds=0.001)) == (0.0, 0.0)
    assert ctl.draft_cost.count == 1
    switch, prompt = ctl.observe_draft_pass(DraftPass(1, 0.005, catch_up_tokens=100, missed_tokens=25))
    assert abs(switch - 0.001) < 1e-12 and abs(prompt - 0.003) < 1e-12  # 4 ms beyond the pass, 1/4 missed
    assert abs(ctl.feed_cost - 0.00004) < 1e-12 and ctl.draft_cost.count == 1


def zero_verdict_controller(**cfg) -> AdaptiveSpeculation:
    """A controller whose every plan prices zero drafts: verifying a token costs as much as a
    step, and the requests' drafts are rarely accepted. The gate is pinned "on"."""
    ctl = AdaptiveSpeculation(max_k=4, config=AdaptiveConfig(explore_z=0.0, **cfg))
    ctl.seed([(1, 0.001), (5, 0.005)], [])
    for rid in "abcd":
        ctl.observe_acceptance(rid, 4, 0)
    pin_gate(ctl, GateChoice(on=True))
    return ctl


def test_a_zero_verdict_is_held_for_doubling_runs_of_plans():
    """Priced at zero drafts, the plan is not priced again for 1, 2, 4, 8, then 16 plans
    (`zero_plan_hold_max`): what it costs beyond speculation off is the pricing, per step. Held
    plans tell the runner the next step drafts nothing (`drafts_next`), but the hold's last one."""
    ctl = zero_verdict_controller(zero_plan_hold_max=16)
    priced_at, plans = [], []
    for i in range(60):
        before = ctl.num_priced
        plans.append(ctl.plan(list("abcd"), 0, draft_passes_cost=False))
        if ctl.num_priced > before:
            priced_at.append(i)
    assert not any(p.num_draft.get(r) for p in plans for r in "abcd")
    assert priced_at == [0, 2, 5, 10, 19, 36, 53]  # gaps of 1, 2, 4, 8, 16, 16 held plans
    assert [p.drafts_next for p in plans[:6]] == [False, True, False, False, True, False]
    # Held plans fade the histories as priced ones do, once per plan, applied when next priced:
    # 54 plans up to the last pricing, 6 held since.
    a, r = ctl._acc["a"]
    d = ctl.config.history_decay
    assert abs(r - d**54) < 1e-12 and a == 0.0 and ctl._held == 6
    # 0: priced every plan, as before the hold.
    every = zero_verdict_controller(zero_plan_hold_max=0)
    for _ in range(10):
        every.plan(list("abcd"), 0, draft_passes_cost=False)
    assert every.num_priced == 10


def test_a_held_zero_verdict_ends_with_the_bucket_or_a_new_request():
    ctl = zero_verdict_controller()
    for _ in range(8):  # holds of 1 and 2, then 4 under way
        ctl.plan(list("abcd"), 0, draft_passes_cost=False)
    priced = ctl.num_priced
    ctl.plan(list("ab"), 0, draft_passes_cost=False)  # bucket 2, not 3: priced afresh
    assert ctl.num_priced == priced + 1
    ctl.plan(list("ab"), 0, draft_passes_cost=False)  # and held from there, from 1 plan
    assert ctl.num_priced == priced + 1
    ctl.plan(list("ab"), 0, draft_passes_cost=False)  # priced: holds 2
    assert ctl.num_priced == priced + 2
    ctl.plan(list("abc"), 0, draft_passes_cost=False)  # a request joining (same bucket): priced
    assert ctl.num_priced == priced + 3
    ctl.plan(list("ac"), 0, draft_passes_cost=False)  # a request leaving: held
    assert ctl.num_priced == priced + 3


def plans_with_leases(ctl: AdaptiveSpeculation, ids: list[str], steps: int) -> list[Plan]:
    """Plan `steps` steps as the scheduler does: the lease's plan where one holds, else `plan`."""
    return [ctl.leased(ids, len(ids)) or ctl.plan(ids, 0, draft_passes_cost=False) for _ in range(steps)]


def test_a_held_zero_verdict_is_leased_without_asking_the_gate():
    """With the real gate (nothing measured: it answers "on" until a step drafts), a held zero
    verdict is leased: the held plans are handed out without asking the gate, the same plans as
    without leases (priced at the same steps, the same `drafts_next`), and the gate has counted
    every step. A request joining ends the lease, and is priced."""

    def controller(lease_max: int) -> AdaptiveSpeculation:
        ctl = AdaptiveSpeculation(max_k=4, config=AdaptiveConfig(explore_z=0.0, lease_max_steps=lease_max))
        ctl.seed([(1, 0.001), (5, 0.005)], [])
        for rid in "abcd":
            ctl.observe_acceptance(rid, 4, 0)
        return ctl

    leasing, asking = controller(16), controller(0)
    asked = []
    choose = leasing.gate.choose
    leasing.gate.choose = lambda n: asked.append(n) or choose(n)  # type: ignore[method-assign]
    got, want = plans_with_leases(leasing, list("abcd"), 60), plans_with_leases(asking, list("abcd"), 60)
    assert [(p.num_draft, p.gate_on, p.drafts_next) for p in got] == [
        (p.num_draft, p.gate_on, p.drafts_next) for p in want
    ]
    assert leasing.num_priced == asking.num_priced == 7
    assert sum(p.leased for p in got) == 60 - 7 and len(asked) == 7
    assert not any(p.leased for p in want)
    leasing.plan(list("abcd"), 0, draft_passes_cost=False)  # settles the lease's steps
    assert leasing.gate.steps == asking.gate.steps + 1
    # A held verdict leased; a fifth request joins (the same bucket): no lease for it, priced.
    joined = controller(16)
    joined.plan(list("abcd"), 0, draft_passes_cost=False)  # priced zero: holds (leases) 1
    assert joined.leased(list("abcde"), 5) is None
    assert joined.leased(list("abcd"), 4) is not None
    joined.plan(list("abcde"), 0, draft_passes_cost=False)
    assert joined.num_priced == 2


def test_a_lease_of_the_gates_off_keeps_its_explorations_where_they_were():
    """The gate has measured "off" as better: its verdict is leased between explorations (for at
    most `lease_max_steps` plans), and the explorations come at the same steps as when it is
    asked every step; a change of bucket ends a lease."""

    def gate_modes(lease_max: int) -> tuple[list[bool | None], int]:
        ctl = AdaptiveSpeculation(max_k=4, config=AdaptiveConfig(explore_z=0.0, lease_max_steps=lease_max))
        ctl.seed([(1, 0.001), (5, 0.005)], [])
        for _ in range(5):
            ctl.gate.observe(1, True, 8, 0.0125)  # 640 tokens/s with speculation
            ctl.gate.observe(1, False, 1, 0.001)  # 1000 without
        plans = plans_with_leases(ctl, ["a"], 400)
        return [p.gate_on for p in plans], sum(p.leased for p in plans)

    leased_modes, leased = gate_modes(16)
    asked_modes, none = gate_modes(0)
    assert leased_modes == asked_modes and none == 0
    explorations = [i for i, on in enumerate(asked_modes) if on]
    assert len(explorations) >= 6 and leased > 300, (explorations, leased)
    # The lease is for bucket 1: two requests (bucket 2) are planned afresh.
    ctl = AdaptiveSpeculation(max_k=4, config=AdaptiveConfig(explore_z=0.0))
    for _ in range(5):
        ctl.gate.observe(1, True, 8, 0.0125)
        ctl.gate.observe(1, False, 1, 0.001)
    ctl.plan(["a"], 0, draft_passes_cost=False)
    assert ctl.lease_left > 0 and ctl.leased(["a"], 1) is not None
    assert ctl.leased(["a", "b"], 2) is None


def test_drafting_waits_a_step_when_the_last_step_stored_no_features():
    """A hold ended early (a new bucket) right after a held plan that told the runner to skip the
    step's features: the re-priced plan drafts nothing yet (a Medusa proposal would read a
    feature never stored) but stores them, and the next plan drafts."""
    ctl = zero_verdict_controller()
    ctl.plan(list("abcd"), 0, draft_passes_cost=False)  # priced zero: holds 1
    ctl.plan(list("abcd"), 0, draft_passes_cost=False)  # held (its last): drafts_next
    ctl.plan(list("abcd"), 0, draft_passes_cost=False)  # priced zero: holds 2
    held = ctl.plan(list("abcd"), 0, draft_passes_cost=False)
    assert not held.drafts_next  # the runner may skip this step's features
    for rid in "ab":  # now drafting pays for these two, in a smaller bucket
        ctl._acc[rid] = (50.0, 0.0)
    ctl.step_cost.set_shape([(1, 0.001), (5, 0.0011)])
    first = ctl.plan(list("ab"), 0, draft_passes_cost=False)
    assert not any(first.num_draft.values()) and first.drafts_next
    second = ctl.plan(list("ab"), 0, draft_passes_cost=False)
    assert second.num_draft["a"] > 0


def test_explorations_back_off_while_they_confirm_the_verdict():
    """A clear loss ("on" at 0.9x the "off" rate: every 34 steps), explored again and again without changing the
    verdict: each exploration doubles the interval to the next (up to `explore_backoff_max`
    times, within `max_explore`); with 0 the interval stays."""

    def starts(backoff_max: int) -> list[int]:
        cfg = AdaptiveConfig(explore_budget=1.0, explore_backoff_max=backoff_max, min_samples=3)
        gate = SpecGate(cfg)
        for on in (True, False):
            for _ in range(3):
                gate.observe(8, on, 8 * (9 if on else 10), 1.0)
        out, prev = [], False
        for i in range(2000):
            on = gate.choose(8).on
            if on and not prev:
                out.append(i)
            prev = on
        return out

    fixed = starts(0)
    gaps = {b - a for a, b in itertools.pairwise(fixed)}
    assert gaps == {34}, gaps
    backed = starts(3)
    gaps_b = [b - a for a, b in itertools.pairwise(backed)]
    # The interval doubles from the second exploration on (it found what the first did), up to
    # 256 (`max_explore`), on the bucket's step counter (so the first 256-interval starts early).
    assert gaps_b[:3] == [34, 68, 136] and set(gaps_b[4:]) == {256}, gaps_b
    assert len(backed) < len(fixed) / 3


def test_a_step_whose_lookups_found_nothing_is_sampled_as_empty_lookups_on_says():
    """The plan gave a request drafts and suffix lookup found none. By default the step is an "off"
    sample (nothing was verified); with `empty_lookups_on` it is filed under "on" (it paid the
    lookup). A step the plan gave no drafts is an "off" sample either way."""
    from tandem.core.request import Request
    from tandem.core.step_io import RunnerOutput, SchedulerOutput
    from tandem.sampling_params import SamplingParams
    from tandem.spec.config import SpeculativeConfig
    from tandem.spec.planner import SpecPlanner

    req = Request(request_id="a", prompt_token_ids=[1, 2, 3], sampling=SamplingParams(), max_tokens=8)
    looked = SchedulerOutput(requests=[req], num_tokens=[1], spec_plan=Plan({"a": 4}, 1, gate_on=True))
    quiet = SchedulerOutput(requests=[req], num_tokens=[1], spec_plan=Plan({}, 1, gate_on=True))
    warm = {"cold_steps": 0}
    default = SpecPlanner(
        SpeculativeConfig.from_dict({"method": "suffix", "num_speculative_tokens": 4, "adaptive": warm})
    )
    default.observe_step(looked, RunnerOutput(), 1, 0.01, 0.01)
    assert default.controller.gate._stats[1][False][2] == 1 and True not in default.controller.gate._stats[1]
    spec = {"method": "suffix", "num_speculative_tokens": 4, "adaptive": {"empty_lookups_on": True, **warm}}
    planner = SpecPlanner(SpeculativeConfig.from_dict(spec))
    gate = planner.controller.gate
    planner.observe_step(looked, RunnerOutput(), 1, 0.01, 0.01)
    assert gate._stats[1][True][2] == 1 and False not in gate._stats[1]
    planner.observe_step(quiet, RunnerOutput(), 1, 0.01, 0.01)
    assert gate._stats[1][False][2] == 1


def blocked_controller() -> AdaptiveSpeculation:
    """Four requests whose drafts pay at zero overhead (a 13 ms step, verification nearly free),
    after drafting steps that each cost 31 ms more than the step-cost line says (verification
    running into a slow path): priced at that overhead, no plan drafts. The gate is pinned "on"."""
    ctl = AdaptiveSpeculation(max_k=32)
    ctl.seed([(4, 0.013), (132, 0.015)], [])
    for rid in "abcd":
        for _ in range(5):
            ctl.observe_acceptance(rid, 8, 1)
    pin_gate(ctl, GateChoice(on=True))
    assert sum(ctl.plan(list("abcd"), 0, draft_passes_cost=False).num_draft.values()) > 0
    for _ in range(60):
        ctl.observe_step(4 + 64, 0.013 + 0.031, drafted=True)
    assert sum(ctl.plan(list("abcd"), 0, draft_passes_cost=False).num_draft.values()) == 0
    return ctl


def test_an_overhead_learned_only_from_drafting_steps_fades_while_nothing_drafts():
    """The overhead is learned only from steps that draft; priced so high that no plan drafts, it
    would never be measured again and speculation would stay off for good, whatever the gate
    chooses. It fades while nothing drafts, so the plan drafts
    again and re-measures it; held zero verdicts count their plans."""
    ctl = blocked_controller()
    waits = 0
    while sum(ctl.plan(list("abcd"), 0, draft_passes_cost=False).num_draft.values()) == 0:
        ctl.observe_step(4, 0.013)  # a step that drafted nothing: it teaches the step-cost line only
        waits += 1
        assert waits < 400, "a stale overhead must not stop speculation for good"
    assert waits > 3  # but not at once
    assert ctl.num_priced < waits  # some of those plans were held, and faded as priced ones


def test_the_overhead_fades_while_the_gate_is_off():
    """While the gate runs "off", nothing drafts and the overhead is not measured either: it fades
    as in zero-drafts "on" steps, so that the gate's next exploration drafts (and measures "on")
    instead of being priced at zero drafts by the stale overhead."""
    ctl = blocked_controller()
    pin_gate(ctl, GateChoice(on=False))
    for _ in range(400):
        assert ctl.plan(list("abcd"), 0, draft_passes_cost=False).gate_on is False
    pin_gate(ctl, GateChoice(on=True, exploring=True))
    assert sum(ctl.plan(list("abcd"), 0, draft_passes_cost=False).num_draft.values()) > 0


def test_the_overhead_is_priced_per_draft_token():
    """Verification that costs more per draft token than the step-cost line says (1 ms a token
    here, beyond 1 ms per drafting step) is learned as a line in the draft tokens: a small draft
    still pays where a large one does not. One fixed overhead, the samples' mean, prices them
    alike: here both as losses, so the request would not draft at all."""

    def controller() -> AdaptiveSpeculation:
        ctl = AdaptiveSpeculation(max_k=32, config=AdaptiveConfig(explore_z=0.0, overhead_prior_samples=0.0))
        ctl.seed([(1, 0.010), (33, 0.010)], [])  # a 10 ms step however many tokens it verifies
        for _ in range(3):
            ctl.observe_acceptance("a", 4, 2)  # alpha about 0.63
        pin_gate(ctl, GateChoice(on=True))
        return ctl

    ctl, fixed = controller(), controller()
    for _ in range(20):
        for k in (4, 16, 32):
            ctl.observe_step(1 + k, 0.010 + 0.001 + 0.001 * k, drafted=True, draft_tokens=k)
            fixed.observe_step(1 + k, 0.010 + 0.001 + 0.001 * k, drafted=True)  # all at x = 0
    o0, o1 = ctl.overhead.coefficients()
    # (The first samples were capped at a step's cost above the line, which 60 samples forget.)
    assert abs(o0 - 0.001) < 1e-5 and abs(o1 - 0.001) < 1e-6 and ctl.spec_overhead == o0
    # Priced per token: 1.63 tokens in 12 ms beats 1 in 10 ms, 2.7 in 43 ms (k = 32) does not.
    k = ctl.plan(["a"], 0, draft_passes_cost=False).num_draft["a"]
    assert 1 <= k <= 4, k
    assert 0.017 < fixed.spec_overhead < 0.021  # about the mean residual, 18.3 ms (recent ones weigh more)
    assert sum(fixed.plan(["a"], 0, draft_passes_cost=False).num_draft.values()) == 0


def test_runs_of_accepted_drafts_are_priced_as_runs():
    """A request whose drafts are accepted in long runs or not at all (copying, then prose) gets
    longer drafts than the per-token rate alone would give it (alpha ** depth), and one whose
    evidence has no runs is priced exactly as that geometric model prices it."""

    def controller() -> AdaptiveSpeculation:
        ctl = AdaptiveSpeculation(max_k=32, config=AdaptiveConfig(warmup_steps=0))
        # c=1 on a CPU: a step's fixed part dominates, each verified token adds 2% of it
        ctl.seed([(1, 0.010), (33, 0.0164)], [])
        pin_gate(ctl, GateChoice(True))
        return ctl

    runs, geometric = controller(), controller()
    for _ in range(4):  # a run of 30 accepted drafts, then three proposals rejected outright
        for ctl in (runs, geometric):
            ctl.observe_acceptance("a", 32, 30)
            for _ in range(3):
                ctl.observe_acceptance("a", 32, 0)
    geometric._run.clear()  # the same per-token evidence, priced without its runs
    alpha = runs.optimistic_alpha("a")
    assert alpha == geometric.optimistic_alpha("a") and runs.continuation("a", alpha) > 0.9 > alpha
    k_runs = runs.plan(["a"], 0, draft_passes_cost=False).num_draft["a"]
    k_geo = geometric.plan(["a"], 0, draft_passes_cost=False).num_draft["a"]
    assert k_runs >= 2 * k_geo > 0, (k_runs, k_geo)
    # Without run evidence the continuation is the per-token rate: the geometric plan.
    assert geometric.continuation("a", alpha) == alpha
    iid = controller()
    for _ in range(6):
        iid.observe_acceptance("b", 4, 1)  # one accepted and the next rejected, every time
    assert iid.continuation("b", iid.optimistic_alpha("b")) < iid.optimistic_alpha("b")


def test_one_slow_drafting_step_does_not_stop_drafting():
    """A drafting step stretched by a one-time cost (40 ms beyond a 3 ms step: a collection pause,
    the first use of the verification path) moves the overhead line by at most a step's cost,
    and while the line rests on few samples it is priced shrunk toward none
    (`overhead_prior_samples`): the request still drafts, and so the overhead is measured again.
    Fitted to that sample alone, the plan drafted nothing until the overhead faded."""
    ctl = AdaptiveSpeculation(max_k=4, config=AdaptiveConfig(explore_z=0.0))
    ctl.seed([(1, 0.003), (5, 0.003)], [])
    for _ in range(3):
        ctl.observe_acceptance("a", 4, 3)
    pin_gate(ctl, GateChoice(on=True))
    assert sum(ctl.plan(["a"], 0, draft_passes_cost=False).num_draft.values()) == 4
    ctl.observe_step(5, 0.043, drafted=True, draft_tokens=4)
    assert ctl.overhead.predict(4) <= 0.003 + 1e-12 and ctl.spec_overhead <= 0.003 / 4 + 1e-12
    assert sum(ctl.plan(["a"], 0, draft_passes_cost=False).num_draft.values()) > 0
    # A true overhead that large is still learned: within a few more such steps drafting stops.
    drafts = []
    for _ in range(8):
        ctl.observe_step(5, 0.043, drafted=True, draft_tokens=4)
        drafts.append(sum(ctl.plan(["a"], 0, draft_passes_cost=False).num_draft.values()))
    assert drafts[-1] == 0, drafts


def test_an_engines_first_steps_are_no_samples():
    """The first `cold_steps` pure-decode steps an engine runs pay one-time costs: the planner
    files none of them (gate rates, cost lines), and files the steps after them."""
    from tandem.core.request import Request
    from tandem.core.step_io import RunnerOutput, SchedulerOutput
    from tandem.sampling_params import SamplingParams
    from tandem.spec.config import SpeculativeConfig
    from tandem.spec.planner import SpecPlanner

    req = Request(request_id="a", prompt_token_ids=[1, 2, 3], sampling=SamplingParams(), max_tokens=8)
    step = SchedulerOutput(requests=[req], num_tokens=[1], spec_plan=Plan({}, 1, gate_on=False))
    spec = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": {"cold_steps": 5}}
    planner = SpecPlanner(SpeculativeConfig.from_dict(spec))
    stats = planner.controller.gate._stats
    for _ in range(5):
        planner.observe_step(step, RunnerOutput(), 1, 0.01, 0.01)
    assert not stats and planner.controller.step_cost.count == 0
    planner.observe_step(step, RunnerOutput(), 1, 0.01, 0.01)
    assert stats[1][False][2] == 1 and planner.controller.step_cost.count == 1


def test_an_engines_first_drafting_steps_teach_the_overhead_alone():
    """In the cold steps a step that drafted still teaches the overhead line (capped and shrunk,
    so a method that does not pay stops drafting before they end), and nothing else."""
    from tandem.core.request import Request
    from tandem.core.step_io import RunnerOutput, SchedulerOutput
    from tandem.sampling_params import SamplingParams
    from tandem.spec.config import SpeculativeConfig
    from tandem.spec.planner import SpecPlanner

    req = Request(request_id="a", prompt_token_ids=[1, 2, 3], sampling=SamplingParams(), max_tokens=8)
    step = SchedulerOutput(
        requests=[req], num_tokens=[5], num_draft={"a": 4}, spec_plan=Plan({"a": 4}, 1, gate_on=True)
    )
    spec = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": {"cold_steps": 5}}
    planner = SpecPlanner(SpeculativeConfig.from_dict(spec))
    ctl = planner.controller
    ctl.seed([(1, 0.010), (8, 0.011), (64, 0.020)], [])
    drafts = []
    for _ in range(4):
        drafts.append(sum(ctl.plan(["a"], 0, draft_passes_cost=False).num_draft.values()))
        ctl.observe_acceptance("a", 4, 1)
        planner.observe_step(step, RunnerOutput(), 2, 0.040, 0.040)  # 30 ms beyond the step
    assert ctl.overhead.count == 4 and ctl.step_cost.count == 0 and not ctl.gate._stats
    assert drafts[0] > 0 and drafts[-1] == 0, drafts


def test_a_leased_step_is_no_sample_and_a_prompt_step_no_gate_step():
    """Through the planner as the engine calls it: a step under the lease files nothing (no gate
    rate, no step cost), and one that computed prompt tokens too is not counted as a gate step
    when the lease settles (`plan` answers such steps without the gate)."""
    from tandem.core.request import Request
    from tandem.core.step_io import RunnerOutput, SchedulerOutput
    from tandem.sampling_params import SamplingParams
    from tandem.spec.config import SpeculativeConfig
    from tandem.spec.planner import SpecPlanner

    spec = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": {"cold_steps": 0, "explore_z": 0.0}}
    planner = SpecPlanner(SpeculativeConfig.from_dict(spec))
    ctl, gate = planner.controller, planner.controller.gate
    for _ in range(5):
        gate.observe(2, True, 16, 0.0125)  # "off" measured better, for 2-3 requests
        gate.observe(2, False, 2, 0.001)
    a = Request(request_id="a", prompt_token_ids=[1, 2, 3], sampling=SamplingParams(), max_tokens=8)
    b = Request(request_id="b", prompt_token_ids=[4, 5, 6], sampling=SamplingParams(), max_tokens=8)
    c = Request(request_id="c", prompt_token_ids=[7, 8, 9], sampling=SamplingParams(), max_tokens=8)
    first = ctl.plan(["a", "b"], 0, draft_passes_cost=False)
    assert first.gate_on is False and ctl.lease_left > 2
    samples, steps, count = gate._stats[2][False][2], gate._steps[2], ctl.step_cost.count
    decode = planner.leased([a, b])
    assert decode is not None and decode.leased
    pure = SchedulerOutput(requests=[a, b], num_tokens=[1, 1], spec_plan=decode)
    planner.observe_step(pure, RunnerOutput(), 2, 0.01, 0.01)
    prompt = planner.leased([a, b, c])  # the same bucket: c's prompt step is leased too
    assert prompt is not None
    with_prompt = SchedulerOutput(requests=[a, b, c], num_tokens=[1, 1, 3], spec_plan=prompt)
    planner.observe_step(with_prompt, RunnerOutput(), 2, 0.01, 0.01)
    assert gate._stats[2][False][2] == samples and ctl.step_cost.count == count
    ctl.plan(["a", "b", "c"], 0, draft_passes_cost=False)  # settles: one leased gate step, then this
    assert gate._steps[2] == steps + 2


def test_a_lookup_prices_its_own_proposal():
    """With a lookup (suffix speculation), a request's tokens are priced at the proposal's own
    probabilities times the calibration, not at its history: a confident copy gets every node
    even after a stretch of rejections, an unlikely one none, and no more tokens than it lists.
    Such a zero verdict is not held: every plan looks again."""
    ctl = AdaptiveSpeculation(max_k=32, config=AdaptiveConfig(warmup_steps=0))
    ctl.seed([(1, 0.010), (33, 0.0164)], [])  # c=1: a verified token adds 2% of a step
    pin_gate(ctl, GateChoice(True))
    for _ in range(6):
        ctl.observe_acceptance("a", 8, 0)  # prose: every draft rejected
    by_history = ctl.plan(["a"], 0, draft_passes_cost=False).num_draft.get("a", 0)
    copy = [0.98] * 20
    looked = []

    def lookup(probs):
        def call():
            looked.append(1)
            return {"a": probs}

        return call

    assert ctl.plan(["a"], 0, False, lookup=lookup(copy)).num_draft["a"] == 20 > 2 * by_history
    unlikely = [0.01] * 20
    for _ in range(5):
        assert ctl.plan(["a"], 0, False, lookup=lookup(unlikely)).num_draft.get("a", 0) == 0
    assert len(looked) == 6  # zero verdicts under a lookup are priced, and looked up, every plan
    # A lookup whose probabilities overstate acceptance (half of what it expects) is priced lower.
    branchy = [0.9, 0.5, 0.3, 0.2, 0.12, 0.08, 0.05, 0.03]
    before = ctl.plan(["a"], 0, False, lookup=lookup(branchy)).num_draft["a"]
    for _ in range(10):
        ctl.observe_lookup(4.0, 1)
    assert ctl.lookup_calibration < 0.4
    after = ctl.plan(["a"], 0, False, lookup=lookup(branchy)).num_draft.get("a", 0)
    assert after < before, (before, after)


def test_the_planner_hands_out_the_priced_suffix_proposal_and_files_its_calibration():
    """Through the planner: suffix speculation under the controller looks up each decoding
    request's proposal once, prices it, hands out its first k tokens, and files how many of the
    tokens it expected were accepted."""
    from tandem.core.request import Request
    from tandem.sampling_params import SamplingParams
    from tandem.spec.config import SpeculativeConfig
    from tandem.spec.planner import SpecPlanner

    spec = {"method": "suffix", "num_speculative_tokens": 8, "adaptive": {"warmup_steps": 0}}
    planner = SpecPlanner(SpeculativeConfig.from_dict(spec))
    ctl = planner.controller
    ctl.seed([(1, 0.010), (33, 0.0164)], [])
    pin_gate(ctl, GateChoice(True))
    text = list(range(100, 130))
    req = Request(request_id="a", prompt_token_ids=text + text[:6], sampling=SamplingParams(), max_tokens=64)
    calls = []
    scored = planner.suffix.scored
    planner.suffix.scored = lambda r, k: calls.append(k) or scored(r, k)  # type: ignore[method-assign]
    plan = planner.plan([req], 0, 4096)
    k = plan.num_draft["a"]
    assert calls == [8] and k == 6  # the match of 6 tokens drafts 6 (max_spec_factor 1)
    proposal = planner.propose(req, 4)  # the scheduler's budget cut it to 4
    tokens = list(proposal.tokens) if hasattr(proposal, "tokens") else proposal
    assert tokens == text[6:10] and calls == [8]  # the priced proposal, not a second lookup
    planner.observe(req, 4, 2)
    assert ctl._lookup_accepted == 2 and abs(ctl._lookup_expected - 4.0) < 1e-9
    off = SpecPlanner(SpeculativeConfig.from_dict(spec | {"adaptive": {"lookup_pricing": False}}))
    off.suffix.scored = lambda r, k: calls.append(k) or scored(r, k)  # type: ignore[method-assign]
    off.controller.seed([(1, 0.010), (33, 0.0164)], [])
    pin_gate(off.controller, GateChoice(True))
    off.plan([req], 0, 4096)
    assert calls == [8]
