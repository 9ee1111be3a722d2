"""The scheduler owns speculation's cost (issue 44).

1. While the controller keeps a draft head off, a step costs the drafter one feature-store write of
   the step's own rows (EAGLE; Medusa none while a zero verdict holds) and no head pass: counted
   per step through the real runner, so a drafter that copied a request's whole context per step
   (O(L) a step), ran its head, or (Medusa) stored features no proposal reads fails.
2. A head's tree of k nodes takes min(tree_depth, k) EAGLE passes: a smaller node budget is cheaper.
3. The plan's node budget follows measured costs: with a fake cost source, the choice flips to
   smaller trees and then to none as verification (the step line's slope over the batch's tokens,
   tree nodes included) or head passes cost more.
4. Exploration is bounded: over many steps and batch sizes, steps in the worse mode stay within
   the budget, and exploring a passes method runs a small proposal.
"""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import pytest
from test_draft_heads import make_head
from test_spec_decode import TARGET, make_prompts
from test_tree_engine import run

import tandem.engine.core as engine_core
import tandem.worker.head_drafter as head_drafter
import tandem.worker.model_runner as model_runner
from tandem import LLM, SamplingParams
from tandem.core.step_io import DraftPass
from tandem.model.draft_heads import MedusaHeads
from tandem.model.llama import LlamaForCausalLM
from tandem.spec.config import AdaptiveConfig
from tandem.spec.controller import AdaptiveSpeculation
from tandem.spec.gate import SpecGate


@pytest.fixture(scope="module")
def target_dir(model_factory):
    return model_factory("llama", **TARGET)


@pytest.fixture
def steps(monkeypatch) -> list[dict]:
    """Per runner step: drafted or not, its tokens, and what the head drafter did in it."""
    seen: list[dict] = []
    execute = model_runner.ModelRunner.execute

    def recording(self, sched):
        heads = self.head_drafter
        if heads is None or sched.is_empty:
            return execute(self, sched)
        w = heads.work
        passes, writes, rows = w.passes, w.feature_writes, w.feature_rows
        out = execute(self, sched)
        seen.append(
            {
                "drafted": bool(sched.num_draft),
                "tokens": sched.total_tokens,
                "passes": w.passes - passes,
                "writes": w.feature_writes - writes,
                "rows": w.feature_rows - rows,
                "drafts_next": getattr(sched.spec_plan, "drafts_next", True),
                "leased": getattr(sched.spec_plan, "leased", False),
            }
        )
        return out

    monkeypatch.setattr(model_runner.ModelRunner, "execute", recording)
    return seen


def test_a_step_without_drafts_costs_one_feature_write_and_no_head_pass(target_dir, tmp_path, steps) -> None:
    """A random head's drafts are never accepted: the controller turns it off, and from then on the
    drafter's per-step work is one write of the step's rows, however long the requests have grown."""
    head = make_head(target_dir, "eagle", tmp_path / "eagle")
    _, base, _ = run(target_dir, None)
    spec = {"method": "eagle", "model": str(head), "num_speculative_tokens": 6, "tree_topk": 2}
    llm, got, _ = run(target_dir, spec)
    assert got == base
    off = [s for s in steps if not s["drafted"]]
    on = [s for s in steps if s["drafted"]]
    assert len(off) > 20 and on, (len(off), len(on))
    for s in off:
        assert s["passes"] == 0 and s["writes"] == 1 and s["rows"] == s["tokens"], s
    # EAGLE stores every step's features, also while a zero verdict holds (its catch-up feeds
    # every position since its KV ends).
    assert any(s["drafts_next"] is False for s in off)
    # Most of those steps' plans were leased: no gate asked, no pricing, no sample.
    leased = sum(s["leased"] for s in off)
    assert leased > len(off) // 3 and not any(s["leased"] for s in on), (leased, len(off))
    # A drafting step: at most a catch-up pass and one per expanded depth, and its rows plus moves.
    for s in on:
        assert 1 <= s["passes"] <= 6 and s["writes"] == 1 and s["rows"] >= s["tokens"], s
    assert llm.engine.counters.spec_decode_num_draft_tokens > 0


def test_medusa_stores_no_features_while_a_zero_verdict_holds(
    target_dir, tmp_path, steps, monkeypatch
) -> None:
    """Medusa reads only the last known feature: while the controller holds a zero verdict
    (`Plan.drafts_next` False), a step stores nothing, and every step before one that drafts
    stored its features. Output unchanged. On a virtual clock (a Medusa pass costs five target
    steps), so the verdict follows from the work, not from the machine's load: the first decode
    step drafts (no pass timed yet), and none after."""
    head = make_head(target_dir, "medusa", tmp_path / "medusa")
    clock = SimpleNamespace(now=0.0)
    virtual = SimpleNamespace(perf_counter=lambda: clock.now, monotonic=lambda: clock.now)
    for module in (engine_core, model_runner, head_drafter):
        monkeypatch.setattr(module, "time", virtual)
    target_forward, medusa_forward = LlamaForCausalLM.forward, MedusaHeads.forward

    def target_costed(self, batch, kv_caches):
        clock.now += 2e-3 + 2e-5 * len(batch.input_ids)
        return target_forward(self, batch, kv_caches)

    def medusa_costed(self, features):
        clock.now += 10e-3
        return medusa_forward(self, features)

    monkeypatch.setattr(LlamaForCausalLM, "forward", target_costed)
    monkeypatch.setattr(MedusaHeads, "forward", medusa_costed)
    # Four requests decoding together to the end (a request joining ends a hold).
    prompts = [{"prompt_token_ids": p} for p in make_prompts()[:4]]
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    def generate(spec):
        llm = LLM(str(target_dir), speculative_config=spec, max_num_seqs=4, num_threads=1)
        return llm, [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]

    _, base = generate(None)
    spec = {"method": "medusa", "model": str(head), "num_speculative_tokens": 6, "tree_topk": 2}
    llm, got = generate(spec)
    assert got == base
    skipped = [s for s in steps if s["writes"] == 0]
    assert len(skipped) > 20, steps
    for s in skipped:
        assert not s["drafted"] and s["drafts_next"] is False and s["passes"] == 0, s
    for before, s in itertools.pairwise(steps):
        if s["drafted"]:
            assert before["writes"] == 1 and s["writes"] == 1, (before, s)
    assert llm.engine.counters.spec_decode_num_draft_tokens > 0


def test_a_smaller_tree_takes_fewer_head_passes(target_dir, tmp_path, monkeypatch) -> None:
    head = make_head(target_dir, "eagle", tmp_path / "eagle")
    per_proposal: list[int] = []
    propose = head_drafter.HeadDrafter.propose

    def recording(self, todo):
        trees = propose(self, todo)
        if self.passes:
            per_proposal.append(len(self.passes))
        return trees

    monkeypatch.setattr(head_drafter.HeadDrafter, "propose", recording)
    for k in (1, 2, 6):
        per_proposal.clear()
        spec = {"method": "eagle", "model": str(head), "num_speculative_tokens": k, "adaptive": False}
        spec |= {"tree_topk": 2, "tree_depth": 4}
        run(target_dir, spec)
        assert per_proposal and max(per_proposal) == min(4, k), (k, per_proposal)


def eagle_controller(verify_slope: float, pass_seconds: float, **cfg) -> AdaptiveSpeculation:
    """A controller pricing an EAGLE-like method (passes = min(6, k)) from a fake cost source: a
    step of t tokens takes 2 ms + verify_slope * t, a head pass pass_seconds."""
    ctl = AdaptiveSpeculation(
        max_k=8, config=AdaptiveConfig(explore_z=0.0, **cfg), passes_for=lambda k: min(6, k)
    )
    ctl.seed([(t, 0.002 + verify_slope * t) for t in (1, 9, 64, 576)], [])
    for _ in range(20):
        ctl.observe_draft_pass(DraftPass(4, pass_seconds))
    for rid in "abcd":
        for _ in range(30):
            ctl.observe_acceptance(rid, 8, 6)  # alpha about 0.86
    for _ in range(3):  # the gate has seen speculation pay here
        ctl.gate.observe(4, True, 12, 0.003)
        ctl.gate.observe(4, False, 4, 0.003)
    return ctl


def total(ctl: AdaptiveSpeculation) -> int:
    return sum(ctl.plan(list("abcd"), 0, draft_passes_cost=True).num_draft.values())


def test_the_node_budget_follows_measured_verify_and_pass_costs() -> None:
    cheap = total(eagle_controller(verify_slope=1e-6, pass_seconds=1e-5))
    assert cheap == 32  # verification and passes nearly free: the whole budget, every request
    # Verification rising with the batch's tokens: smaller trees, then none.
    dearer = total(eagle_controller(verify_slope=2e-4, pass_seconds=1e-5))
    assert 0 < dearer < cheap
    assert total(eagle_controller(verify_slope=5e-3, pass_seconds=1e-5)) == 0
    # Head passes as dear as a target step: fewer passes (a shallower tree), then none.
    passes = total(eagle_controller(verify_slope=1e-6, pass_seconds=4e-4))
    assert 0 < passes < cheap
    assert total(eagle_controller(verify_slope=1e-6, pass_seconds=5e-3)) == 0


def test_exploring_a_passes_method_runs_a_small_proposal() -> None:
    ctl = eagle_controller(verify_slope=1e-6, pass_seconds=1e-5, explore_max_passes=2)
    ctl.gate = SpecGate(ctl.config)  # nothing measured: "on" is tried, as an exploration
    plan = ctl.plan(list("abcd"), 0, draft_passes_cost=True)
    assert plan.gate_on and max(plan.num_draft.values()) == 2


def test_exploration_stays_within_its_budget() -> None:
    """Speculation at a fifth of off's rate, batch sizes wandering over 1-64 (seven buckets): the
    steps run "on" are the buckets' first tries plus what the budget's share of lost steps allows."""
    cfg = AdaptiveConfig(explore_budget=0.02, explore_every=8, min_samples=3)
    gate = SpecGate(cfg)
    rng = random.Random(0)
    n, on_steps, steps = 8, 0, 20000
    for _ in range(steps):
        n = max(1, min(64, n + rng.choice((-1, 0, 1))))
        on = gate.choose(n).on
        on_steps += on
        gate.observe(n, on, n * (1 if on else 5), 0.01)
    buckets = len({SpecGate.bucket(x) for x in range(1, 65)})
    # Each "on" step loses 4 steps against off; a bucket's first tries are not explorations.
    assert gate.explored <= cfg.explore_budget * steps + 4 * cfg.min_samples
    assert 4 * on_steps <= cfg.explore_budget * steps + 4 * cfg.min_samples * (1 + buckets)
    unbounded = SpecGate(AdaptiveConfig(explore_budget=1.0, explore_every=8, min_samples=3, explore_cost=1.0))
    n, more = 8, 0
    for _ in range(steps):
        n = max(1, min(64, n + rng.choice((-1, 0, 1))))
        on = unbounded.choose(n).on
        more += on
        unbounded.observe(n, on, n * (1 if on else 5), 0.01)
    assert more > 2 * on_steps  # the budget, not the workload, held exploration down


def test_a_close_call_is_rechecked_on_its_schedule_within_the_budget() -> None:
    cfg = AdaptiveConfig(explore_budget=0.02, explore_every=8, min_samples=3)
    close = SpecGate(cfg)
    for _ in range(2):  # speculation 1% slower: re-checked every explore_every steps
        close.choose(8)
        for on in (True, False):
            for _ in range(3):
                close.observe(8, on, 8 * (99 if on else 100), 1.0)
    tries = sum(close.choose(8).on for _ in range(400))
    assert tries >= 400 // 8 * 3 // 2  # not held back by the budget
