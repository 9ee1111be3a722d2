"""Speculative decoding in the scheduler, with the fake runner of tests/scheduler_harness.py (no
torch, no model).

A fake `SpecHook` (`RandomDrafts`) asks for a random number of draft tokens per decoding request,
either proposing them itself (as n-gram lookup does, possibly fewer than asked) or leaving them to
the runner (as a draft model does). The runner verifies them against a deterministic target (the
outputs must equal those of the run without speculation) or accepts a random prefix and samples a
random token (only the invariants are checked). The harness checks, after every step, the token
budget with drafts counted, drafts only on decoding requests and only as many as planned, `update`
rewinding over rejected drafts without freeing or swapping a block, every cached block holding only
verified tokens' KV, and drafts never making a request wait for blocks or preempt another.
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
    RandomDrafts,
    Workload,
    continuation,
    make_group,
    next_token,
    path_tokens,
    reference,
    room,
    tree_nodes,
)

from tandem.core.policy import SchedulingConfig
from tandem.core.request import Request, RequestStatus
from tandem.spec.config import MAX_SPECULATIVE_TOKENS, SpeculativeConfig
from tandem.spec.controller import Plan
from tandem.spec.planner import SpecPlanner

# -- random workloads --------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """A workload and how to run it."""

    w: Workload
    prefix_caching: bool
    policy: str
    max_k: int


@st.composite
def cases(draw) -> Case:
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_num_seqs = draw(st.integers(1, 5))
    # Prompts from a few shared stems (prefix-cache hits) with repetition (so drafts can be right).
    stems = [draw(st.lists(st.integers(0, VOCAB - 1), min_size=0, max_size=12)) for _ in range(2)]
    groups = []
    for i in range(draw(st.integers(1, 6))):
        stem = stems[draw(st.integers(0, 1))]
        tail = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8))
        prompt = (stem + tail * draw(st.integers(1, 2)))[:30]
        max_tokens = draw(st.integers(1, 16))
        groups.append(
            GroupSpec(
                rid=f"g{i}",
                prompt=tuple(prompt),
                max_tokens=max_tokens,
                n=min(max_num_seqs, draw(st.sampled_from([1, 1, 1, 2, 3]))),
                mode=draw(st.sampled_from(["ignore_eos", "ignore_eos", "eos", "stop_token"])),
                stop=draw(st.integers(0, VOCAB - 1)),
                min_tokens=draw(st.integers(0, max_tokens)),
                arrival=draw(st.integers(0, 6)),
                priority=draw(st.integers(0, 2)),
            )
        )
    w = Workload(
        block_size=block_size,
        max_num_batched_tokens=draw(st.integers(1, 24)),
        max_num_seqs=max_num_seqs,
        groups=tuple(groups),
        extra_blocks=draw(st.sampled_from([0, 1, 2, 4, 64])),
        aborts=tuple(draw(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 50)), max_size=2))),
    )
    return Case(
        w,
        prefix_caching=draw(st.booleans()),
        policy=draw(st.sampled_from(["fcfs", "fcfs", "priority", "lpm"])),
        max_k=draw(st.integers(1, 6)),
    )


def harness(c: Case, mode: str | None, deterministic: bool = True, seed: int = 0) -> Harness:
    return Harness(
        c.w.tight_blocks,
        c.w.block_size,
        c.w.max_num_seqs,
        c.w.max_num_batched_tokens,
        c.w.max_model_len,
        enable_prefix_caching=c.prefix_caching,
        config=SchedulingConfig(policy=c.policy),
        mode=mode,
        max_k=c.max_k,
        deterministic=deterministic,
        seed=seed,
    )


def report(h: Harness) -> None:
    if h.sched.counters.num_preemptions:
        event("preempted")
    if h.num_rewound:
        event("rejected drafts rewound")
    if h.num_accepted:
        event("drafts accepted")
    if h.num_extra_blocks:
        event("blocks held past the computed tokens after a rewind")
    if h.runner.num_copies:
        event("copy-on-write")
    if h.kv.cache is not None and h.sched.counters.prefix_cache_hits:
        event("prefix-cache hit")


@settings(max_examples=150, deadline=None)
@given(c=cases(), mode=st.sampled_from(["scheduler", "runner"]), seed=st.integers(0, 2**32 - 1))
def test_random_drafts_keep_outputs_and_kv_invariants(c: Case, mode: str, seed: int) -> None:
    """Deterministic target: with random drafts proposed in the scheduler (n-gram style) or in the runner
    (draft-model style), every invariant holds every step, and the outputs equal the run without
    speculation and the reference computed without any scheduler."""
    plain = harness(c, None)
    plain.run(c.w.arrivals(), c.w.aborts)
    spec = harness(c, mode, seed=seed)
    spec.run(c.w.arrivals(), c.w.aborts)
    for rid, r in spec.members.items():
        want = reference(r, c.w.max_model_len)
        if RequestStatus.FINISHED_ABORTED in (r.status, plain.members[rid].status):
            # Aborted at a fixed step: speculation may have got further; the tokens are still the target's.
            assert r.output_token_ids == want[: r.num_output_tokens]
        else:
            assert r.output_token_ids == want == plain.members[rid].output_token_ids
            assert r.status == plain.members[rid].status
    report(spec)


@settings(max_examples=80, deadline=None)
@given(c=cases(), mode=st.sampled_from(["scheduler", "runner"]), seed=st.integers(0, 2**32 - 1))
def test_random_acceptance_keeps_kv_invariants(c: Case, mode: str, seed: int) -> None:
    """A runner that accepts a random prefix of the drafts and samples random tokens: every invariant
    holds every step (the KV read back for every verified token is that of the request's tokens)."""
    h = harness(c, mode, deterministic=False, seed=seed)
    h.run(c.w.arrivals(), c.w.aborts)
    for r in h.members.values():
        assert r.num_output_tokens <= r.max_tokens
    report(h)


# -- targeted scenarios --------------------------------------------------------


def periodic(history: list[int], index: int) -> int:
    """A target that repeats the prompt's period-3 pattern, so n-gram lookup is usually right."""
    return history[-3] if len(history) >= 3 else (history[-1] + 1) % VOCAB


@pytest.mark.parametrize("mode", ["scheduler", "runner"])
def test_rewinds_keep_blocks_and_preemption_still_recomputes(mode: str) -> None:
    """A tight cache with block size 2 and up to 5 drafts: rejected drafts leave blocks allocated past
    the computed tokens (reused by the next step, not freed), requests are preempted and recompute,
    the prefix cache is hit, and the outputs are the target's."""
    c = Case(
        Workload(
            block_size=2,
            max_num_batched_tokens=12,
            max_num_seqs=4,
            extra_blocks=4,
            groups=tuple(
                # g1: two samples forked off a prompt ending mid-block (copy-on-write).
                GroupSpec(
                    rid=f"g{i}",
                    prompt=(1, 2, 3, 4, 5, 6, i, i + 1)[: 7 if i == 1 else 8],
                    max_tokens=14,
                    n=2 if i == 1 else 1,
                    mode="ignore_eos",
                    stop=0,
                    min_tokens=0,
                    arrival=i,
                )
                for i in range(5)
            ),
            aborts=(),
        ),
        prefix_caching=True,
        policy="fcfs",
        max_k=5,
    )
    h = harness(c, mode, seed=3)
    h.run(c.w.arrivals())
    assert h.sched.counters.num_preemptions > 0
    assert h.num_rewound > 0 and h.num_accepted > 0
    assert h.num_extra_blocks > 0
    assert h.sched.counters.prefix_cache_hits > 0
    assert h.runner.num_copies > 0
    for r in h.members.values():
        assert r.output_token_ids == reference(r, c.w.max_model_len)


def test_stop_inside_accepted_drafts_caches_only_kept_tokens() -> None:
    """The target emits the stop token in the middle of an all-correct draft: the tokens after it are
    dropped, `num_computed_tokens` is clamped to the kept tokens and only they reach the prefix cache."""
    stop = 20

    def target(history: list[int], index: int) -> int:
        return stop if len(history) == 10 else (history[-1] + 1) % VOCAB

    class AlwaysSix(RandomDrafts):
        def plan(self, decoding, other_tokens, max_model_len):
            return Plan(
                {r.request_id: min(6, room(r, max_model_len)) for r in decoding if room(r, max_model_len)}
            )

    h = Harness(
        num_blocks=16,
        block_size=2,
        max_num_seqs=2,
        max_num_batched_tokens=32,
        enable_prefix_caching=True,
        mode="runner",
        target=target,
        spec=AlwaysSix("runner", 6, random.Random(0), target),
    )
    # The "draft model" is always right.
    h.runner.make_drafts = lambda req, k: continuation(target, req.token_ids, req.sample_index, k)
    h.add(*make_group("a", [1, 2, 3, 4, 5, 6], max_tokens=12, stop_token_ids=[stop]))
    h.step()  # the prompt
    out = h.step()  # 6 drafts, all accepted; the 4th is the stop token
    a = h.members["a"]
    assert out.num_draft == {"a": 6}
    assert a.output_token_ids == [7, 8, 9, 10, stop]
    assert a.status == RequestStatus.FINISHED_STOPPED
    # Cached: the full blocks of the kept tokens but the last (never fed back), none of the 2 dropped.
    cached = max((path_tokens(n) for n, _ in tree_nodes(h.kv)), key=len)
    assert cached == a.token_ids[:10]
    h.check_end(evict=True)


class MaxDrafts(RandomDrafts):
    """Always asks for as many drafts as may be kept."""

    def plan(self, decoding, other_tokens, max_model_len):
        ks = {r.request_id: min(self.max_k, room(r, max_model_len)) for r in decoding}
        return Plan({rid: k for rid, k in ks.items() if k > 0})


def test_drafts_are_dropped_rather_than_preempting() -> None:
    """`a`'s 3 drafts would need 2 more blocks, only 1 is free: it decodes without drafts, and `b`, which
    holds the other block, is not preempted for them."""
    h = Harness(
        num_blocks=4,
        block_size=2,
        max_num_seqs=2,
        max_num_batched_tokens=16,
        mode="runner",
        spec=MaxDrafts("runner", 4, random.Random(0), next_token),
    )
    h.add(*make_group("a", [1, 2, 3], max_tokens=5))
    h.add(*make_group("b", [4], max_tokens=2))
    h.step()  # both prompts: a holds 2 blocks, b 1
    assert h.kv.pool.num_free == 1
    out = h.step()
    assert not out.preempted and h.sched.counters.num_preemptions == 0
    assert [r.request_id for r in out.requests] == ["a", "b"] and out.num_tokens == [1, 1]
    assert out.num_draft == {} and out.draft_tokens == {}
    while h.sched.has_unfinished():
        h.step()
    h.check_end(evict=True)
    assert h.num_draft_tokens > 0  # once b is done, a drafts again
    for r in h.members.values():
        assert r.output_token_ids == reference(r, h.max_model_len)


class OtherTokens(RandomDrafts):
    """Records the `other_tokens` of every plan."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.seen: list[int] = []

    def plan(self, decoding: list[Request], other_tokens: int, max_model_len: int) -> Plan:
        self.seen.append(other_tokens)
        return super().plan(decoding, other_tokens, max_model_len)


def test_plan_counts_the_prompts_this_step_admits() -> None:
    """Drafts are planned before the queue is admitted: a step that will also admit a prompt must
    not look like a pure-decode step to the plan (the adaptive controller drafts only in those)."""
    spec = OtherTokens("scheduler", 2, random.Random(0), next_token)
    h = Harness(
        num_blocks=32, block_size=4, max_num_seqs=2, max_num_batched_tokens=32, mode="scheduler", spec=spec
    )
    h.add(*make_group("a", [1, 2, 3], max_tokens=6))
    h.step()  # a's prompt; nothing decoding yet, so no plan
    h.add(*make_group("b", [4, 5, 6, 7, 8], max_tokens=3))
    h.add(*make_group("c", [9, 9], max_tokens=3))
    out = h.step()  # a decodes, b is admitted (a free seat), c waits (no seat)
    assert [r.request_id for r in out.requests] == ["a", "b"]
    assert spec.seen[-1] == 5
    out = h.step()  # both decode, c still has no seat: a pure-decode step
    assert "c" not in [r.request_id for r in out.requests]
    assert spec.seen[-1] == 0
    while h.sched.has_unfinished():
        h.step()
    h.check_end(evict=True)


def test_real_planner_ngram_counters() -> None:
    """The real SpecPlanner (n-gram, adaptive off) in the scheduler over a periodic target: n-gram drafts
    are accepted, the outputs are the target's, and the planner's counters add up."""
    planner = SpecPlanner(
        SpeculativeConfig.from_dict(
            {
                "method": "ngram",
                "num_speculative_tokens": 4,
                "prompt_lookup_min": 1,
                "prompt_lookup_max": 3,
                "adaptive": False,
            }
        )
    )
    h = Harness(
        num_blocks=14,
        block_size=2,
        max_num_seqs=3,
        max_num_batched_tokens=10,
        enable_prefix_caching=True,
        mode="scheduler",
        target=periodic,
        spec=planner,
    )
    arrivals = {
        i: [make_group(f"r{i}", [i, 5, 9, 1, 2, 3, 1, 2, 3][: 4 + i], max_tokens=12 + i)] for i in range(4)
    }
    h.run(arrivals)
    for r in h.members.values():
        assert r.output_token_ids == reference(r, h.max_model_len, periodic)
    assert planner.counters.spec_decode_num_draft_tokens == h.num_draft_tokens > 0
    assert planner.counters.spec_decode_num_accepted_tokens == h.num_accepted > 0
    assert planner.counters.spec_decode_num_drafts == h.num_drafted
    per_pos = planner.counters.accepted_per_pos(MAX_SPECULATIVE_TOKENS)
    assert sum(per_pos) == planner.counters.spec_decode_num_accepted_tokens
    assert per_pos == sorted(per_pos, reverse=True)
    assert h.sched.counters.num_preemptions > 0


def test_speculative_config_takes_vllm_keys() -> None:
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    cfg = SpeculativeConfig.from_dict(ngram)
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max, cfg.adaptive) == (1, 4, True)
    # As vLLM: one bound alone sets the other (a lone minimum above the default maximum is valid).
    cfg = SpeculativeConfig.from_dict({**ngram, "prompt_lookup_min": 5})
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (5, 5)
    cfg = SpeculativeConfig.from_dict({**ngram, "prompt_lookup_max": 2, "prompt_lookup_min": None})
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (2, 2)
    cfg = SpeculativeConfig.from_dict({**ngram, "prompt_lookup_min": 2, "prompt_lookup_max": 3})
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (2, 3)
    with pytest.raises(ValueError, match="prompt_lookup_min <= prompt_lookup_max"):
        SpeculativeConfig.from_dict({**ngram, "prompt_lookup_min": 4, "prompt_lookup_max": 3})
    draft = SpeculativeConfig.from_dict(
        {"model": "/some/dir", "num_speculative_tokens": 2, "adaptive": False}
    )
    assert (draft.method, draft.model, draft.adaptive) == ("draft_model", "/some/dir", False)
    for bad in ({**ngram, "num_speculative_tokens": 0}, {**ngram, "method": "mtp"}, {**ngram, "typo": 1}):
        with pytest.raises(ValueError):
            SpeculativeConfig.from_dict(bad)


def test_adaptive_settings_come_from_speculative_config() -> None:
    """`adaptive` is true, false or a dict of the controller's settings (adaptive, with those set);
    a bad setting is a ValueError naming it."""
    from tandem.spec.config import AdaptiveConfig

    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    for flag in (True, False):
        cfg = SpeculativeConfig.from_dict({**ngram, "adaptive": flag})
        assert cfg.adaptive is flag and cfg.adaptive_config == AdaptiveConfig()
    cfg = SpeculativeConfig.from_dict({**ngram, "adaptive": {"explore_z": 1.0, "min_samples": 5}})
    assert cfg.adaptive and (cfg.adaptive_config.explore_z, cfg.adaptive_config.min_samples) == (1.0, 5)
    assert SpecPlanner(cfg).controller.gate.config.min_samples == 5
    for bad, field_name in (
        ({"explore_z": -1}, "explore_z"),
        ({"gate_decay": 1.5}, "gate_decay"),
        ({"min_samples": 0}, "min_samples"),
        ({"warmup_steps": 2.5}, "warmup_steps"),
        ({"history_decay": True}, "history_decay"),
        ({"explore_every": 300}, "max_explore"),
        ({"seed_context": 1}, "seed_context"),
        ({"typo": 1}, "typo"),
    ):
        with pytest.raises(ValueError, match=field_name):
            SpeculativeConfig.from_dict({**ngram, "adaptive": bad})
    with pytest.raises(ValueError, match=r"speculative_config\.adaptive must be"):
        SpeculativeConfig.from_dict({**ngram, "adaptive": "yes"})
