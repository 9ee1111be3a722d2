"""`speculative_config`, as vLLM spells it, and the adaptive controller's settings."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from tandem.spec.suffix import SuffixConfig, parse_suffix_config, suffix_keys

METHODS = ("ngram", "draft_model", "suffix", "eagle", "medusa")
# Methods whose drafts come from heads over the target's own features (tandem/model/draft_heads.py),
# proposed as a tree in the runner (tandem/worker/head_drafter.py).
HEAD_METHODS = ("eagle", "medusa")
# The most drafts a request may verify in one step (suffix speculation drafts long repeats).
MAX_SPECULATIVE_TOKENS = 32
# Draft heads' read-out (`draft_vocab_size`): the tokens the target emits most often, from the head
# folder's draft_vocab.json (tandem/model/draft_vocab.py), instead of the whole LM head. Large
# enough that a real model's answers fall inside it almost always, so acceptance stays as with the
# whole head (the coverage and acceptance behind it: docs/speculative_decoding.md); a target whose
# vocabulary is no larger keeps all of it.
DEFAULT_DRAFT_VOCAB_SIZE = 8192


def _at_least(low: int) -> Callable[[Any], bool]:
    return lambda v: v >= low


@dataclass(frozen=True, slots=True)
class AdaptiveConfig:
    """The adaptive controller's tuning, set as `speculative_config["adaptive"] = {...}`. The defaults
    are the values the benchmarks justify; docs/speculative_decoding.md explains each knob's role in
    the controller and the measurements behind it."""

    # -- acceptance: each request's per-token acceptance has a Beta(prior_accepted, prior_rejected)
    # prior; its history fades by `history_decay` per drafting step, and per step it does not draft.
    prior_accepted: float = 1.0
    prior_rejected: float = 1.0
    history_decay: float = 0.9
    # Drafts are priced at the posterior mean plus this many standard deviations, so a request with
    # little history drafts and gets measured.
    explore_z: float = 0.5
    # Suffix speculation prices each draft token at its empirical probability in the lookup's own
    # proposal (a tree's node: its path's), times the ratio of accepted to expected tokens over
    # past verifications (history-decayed), which starts at 1 with this many expected tokens' weight.
    lookup_prior_tokens: float = 4.0
    # False: suffix drafts are priced from each request's acceptance history, as other methods'.
    lookup_pricing: bool = True
    # -- costs: without costs timed at load, the first `warmup_steps` steps draft the maximum while
    # the step-cost line is fitted online. Weights of the past per sample: the step and draft-pass
    # cost lines, the per-step speculation overhead, and a draft model's catch-up costs.
    warmup_steps: int = 8
    cost_decay: float = 0.98
    overhead_decay: float = 0.9
    feed_decay: float = 0.95
    # The speculation overhead is measured only in steps that draft, so one priced too high to let
    # any plan draft would never be measured again: it fades toward 0 by this factor per step that
    # could have drafted and did not (gate "off" included), until a plan drafts and re-measures it.
    # The trade: a faster fade recovers sooner from a stale overhead, and retries a true one (a
    # drafting step that does not pay) more often; at 0.995 an overhead twice what still lets
    # drafting pay is retried after about 140 steps (docs/speculative_decoding.md). 1: never fades.
    overhead_fade: float = 0.995
    # The overhead's first samples count against a prior of no overhead worth this many samples
    # (the line is priced at count / (count + prior) of its fit): an engine's first drafting steps
    # pay one-time costs (caches cold after load, or after another process ran; the verification
    # path's first use), and a line fitted to one of them alone can price every plan at zero
    # drafts, so that nothing measures it again until it fades. 0: no prior.
    overhead_prior_samples: float = 3.0
    # An engine's first this many pure-decode steps are no samples of anything (gate rates, cost
    # lines): they pay one-time costs (first use of each path, caches cold after load), and a
    # verdict measured on them ("off" better) would hold until the next exploration, which backs
    # off as it confirms. Their plans are priced from the costs timed at load.
    cold_steps: int = 8
    # Costs are timed at load over synthetic batches of up to this many requests, each with
    # `seed_context` tokens of context.
    seed_max_requests: int = 64
    seed_context: int = 128
    # -- the gate, per batch-size bucket: measured on/off rates with `gate_decay` per sample, the
    # mode not run aging by `stale_decay` per step of the other; explorations of `min_samples`
    # steps, spaced so that exploring costs about `explore_cost` of the time, every
    # `explore_every` to `max_explore` steps.
    gate_decay: float = 0.8
    stale_decay: float = 0.97
    min_samples: int = 3
    explore_cost: float = 0.01
    explore_every: int = 8
    max_explore: int = 256
    # Each exploration that finds the bucket's verdict where the previous one left it doubles the
    # interval to the next, at most this many times (still within `max_explore`): a loss measured
    # again and again costs ever less to recheck. 0: every interval is `explore_interval`'s.
    explore_backoff_max: int = 4
    # While the plan prices every request at zero drafts, it holds that verdict instead of pricing
    # again each step: for 1, 2, 4, ... steps after each zero verdict in a row, at most this many
    # (0: price every step). A hold ends early when the gate's choice or batch-size bucket changes
    # or a request joins the decoding batch.
    # What a held step skips is the pricing's Python (the plan's cost, per request, per step).
    zero_plan_hold_max: int = 16
    # Plans that draft nothing (the gate's "off", or a held zero verdict) are handed out without
    # asking the gate for up to this many steps in a row, where its choice cannot change before
    # then without a new sample (until its next exploration check): such steps are no samples,
    # so what speculation kept off costs per step is a counter (0: ask and sample every step).
    lease_max_steps: int = 16
    # True: a pure-decode step whose plan gave a request drafts that the lookup (n-gram, suffix)
    # then did not find is a gate sample of "on" (it paid the lookups). False: an "off" sample, as
    # a step in which nothing was verified; the default, as the faster of the two
    # (docs/speculative_decoding.md, "What is a sample").
    empty_lookups_on: bool = False
    # Over all buckets together, what explorations lose against the better mode (in steps: a
    # close call's cost next to nothing) stays within `explore_budget` of all gate steps, beyond
    # a first allowance of 2 * `min_samples` steps; an exploration due past it waits.
    explore_budget: float = 0.05
    # While the gate explores speculation, a method that drafts in passes (a draft model, EAGLE)
    # runs at most this many: exploring is measured on a small, cheap tree or chain.
    explore_max_passes: int = 2
    # -- draft-model catch-up: tokens one step may feed drafts beyond what proposals feed anyway
    # (the closest request goes through even over it), and the most steps a request's catch-up is
    # priced as paid off over.
    catch_up_tokens_per_step: int = 128
    feed_horizon_steps: int = 32

    @staticmethod
    def from_dict(values: dict[str, Any]) -> AdaptiveConfig:
        known = [f.name for f in fields(AdaptiveConfig)]
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(f"speculative_config.adaptive has unknown keys {unknown}; known: {known}")
        cfg = AdaptiveConfig(**values)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        decays = (
            "history_decay",
            "cost_decay",
            "overhead_decay",
            "overhead_fade",
            "feed_decay",
            "gate_decay",
            "stale_decay",
        )
        for name in decays:
            self._check(name, float, lambda v: 0.0 <= v <= 1.0, "a number in [0, 1]")
        for name in ("prior_accepted", "prior_rejected"):
            self._check(name, float, lambda v: 0.0 < v < math.inf, "a positive number")
        self._check("explore_z", float, lambda v: 0.0 <= v < math.inf, "a number >= 0")
        self._check("lookup_prior_tokens", float, lambda v: 0.0 < v < math.inf, "a positive number")
        self._check("overhead_prior_samples", float, lambda v: 0.0 <= v < math.inf, "a number >= 0")
        self._check("explore_cost", float, lambda v: 0.0 < v <= 1.0, "a number in (0, 1]")
        self._check("explore_budget", float, lambda v: 0.0 <= v <= 1.0, "a number in [0, 1]")
        for name, low in (
            ("warmup_steps", 0),
            ("catch_up_tokens_per_step", 0),
            ("min_samples", 1),
            ("explore_every", 1),
            ("explore_max_passes", 1),
            ("explore_backoff_max", 0),
            ("zero_plan_hold_max", 0),
            ("lease_max_steps", 0),
            ("cold_steps", 0),
            ("feed_horizon_steps", 1),
            ("seed_max_requests", 1),
            ("seed_context", 2),  # the catch-up cost per token is timed over seed_context - 1 tokens
        ):
            self._check(name, int, _at_least(low), f"an integer >= {low}")
        self._check("max_explore", int, lambda v: v >= self.explore_every, "an integer >= explore_every")
        for name in ("empty_lookups_on", "lookup_pricing"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"speculative_config.adaptive.{name} must be true or false, got {getattr(self, name)!r}"
                )

    def _check(self, name: str, kind: type, ok: Callable[[Any], bool], what: str) -> None:
        value = getattr(self, name)
        kinds = (int, float) if kind is float else (int,)
        if isinstance(value, bool) or not isinstance(value, kinds) or not ok(value):
            raise ValueError(f"speculative_config.adaptive.{name} must be {what}, got {value!r}")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None
    # Choose each request's draft length per step from measured costs and acceptance (0 allowed);
    # num_speculative_tokens is the upper bound. False: always propose the maximum.
    adaptive: bool = True
    # How the adaptive choice is made (unused when `adaptive` is False).
    adaptive_config: AdaptiveConfig = field(default_factory=AdaptiveConfig)
    # method "suffix": its `suffix_decoding_*` settings (tandem/spec/suffix.py).
    suffix: SuffixConfig = field(default_factory=SuffixConfig)
    # methods "eagle" and "medusa": the draft tree (num_speculative_tokens nodes at most). Children
    # per expanded node (EAGLE) or per head (Medusa), and the tree's greatest depth (Medusa: at most
    # its number of heads).
    tree_topk: int = 4
    tree_depth: int = 6
    # methods "eagle" and "medusa": tokens the heads' read-out multiplies (0: the whole vocabulary;
    # a size no smaller than the target's vocabulary also reads all of it).
    draft_vocab_size: int = DEFAULT_DRAFT_VOCAB_SIZE

    @property
    def uses_head(self) -> bool:
        return self.method in HEAD_METHODS

    @staticmethod
    def from_dict(spec: dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """`adaptive` may be true, false, or a dict of `AdaptiveConfig` fields (adaptive, so tuned)."""
        if spec is None:
            return None
        if isinstance(spec, SpeculativeConfig):
            return spec
        if not isinstance(spec, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(spec).__name__}")
        known = {
            "method",
            "num_speculative_tokens",
            "prompt_lookup_min",
            "prompt_lookup_max",
            "model",
            "adaptive",
            "tree_topk",
            "tree_depth",
            "draft_vocab_size",
        }
        known |= suffix_keys()
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; known: {sorted(known)}")
        method = spec.get("method")
        if method is None and spec.get("model"):
            method = "draft_model"
        if method == "draft":
            method = "draft_model"
        if "draft_vocab_size" in spec and method not in HEAD_METHODS:
            raise ValueError(
                f"speculative_config.draft_vocab_size applies to methods {HEAD_METHODS}, not {method!r}"
            )
        # As vLLM: a bound given alone (None counts as not given) also sets the other one.
        lo, hi = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
        if lo is None:  # neither given: 1 to 4; one given: both
            lo = 1 if hi is None else hi
            if hi is None:
                hi = 4
        elif hi is None:
            hi = lo
        adaptive = spec.get("adaptive", True)
        if isinstance(adaptive, dict):
            adaptive_config = AdaptiveConfig.from_dict(adaptive)
            adaptive = True
        elif isinstance(adaptive, bool):
            adaptive_config = AdaptiveConfig()
        else:
            raise ValueError(
                "speculative_config.adaptive must be true, false or a dict of the adaptive "
                f"controller's settings, got {adaptive!r}"
            )
        cfg = SpeculativeConfig(
            method=str(method),
            # A head's tree: 8 nodes unless told (vLLM asks for it; {"method": "eagle"} alone works).
            num_speculative_tokens=spec.get("num_speculative_tokens", 8 if method in HEAD_METHODS else 0),
            prompt_lookup_min=lo,
            prompt_lookup_max=hi,
            model=spec.get("model"),
            adaptive=adaptive,
            adaptive_config=adaptive_config,
            suffix=parse_suffix_config(spec),
            tree_topk=spec.get("tree_topk", 4),
            tree_depth=spec.get("tree_depth", 6),
            draft_vocab_size=spec.get("draft_vocab_size", DEFAULT_DRAFT_VOCAB_SIZE),
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {METHODS}, got {self.method!r}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_config.num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}"
            )
        for name in ("tree_topk", "tree_depth"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_SPECULATIVE_TOKENS:
                raise ValueError(
                    f"speculative_config.{name} must be in [1, {MAX_SPECULATIVE_TOKENS}], got {v!r}"
                )
        size = self.draft_vocab_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(
                "speculative_config.draft_vocab_size must be an integer >= 0 (0: the whole vocabulary), "
                f"got {size!r}"
            )
        if self.method == "suffix":
            pass  # its settings were checked as they were read
        elif self.uses_head:
            pass  # no model: the head beside the target's folder (`<target>-eagle`, `<target>-medusa`)
        elif self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
                raise ValueError(
                    "speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, "
                    f"got {lo!r} and {hi!r}"
                )
        elif not self.model:
            raise ValueError(
                "speculative_config with method 'draft_model' needs 'model' (a checkpoint folder)"
            )
        self.adaptive_config.validate()
