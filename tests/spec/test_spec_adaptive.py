"""The adaptive controller end to end, through `LLM` with tiny random models: at the same costs, a
draft model whose drafts are always accepted (a copy of the target) gets speculation on, and one
whose drafts are never accepted (unrelated weights) gets it off.

The controller decides from measured step times, which on a shared machine are noise. Here the
engine's clock is virtual: it advances only by a fixed cost per model forward (a draft pass costs
40% of a target step), so every time the controller sees, at load and per step, and therefore
every decision it makes, follows from the work alone. Nothing below asserts on a time.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

import tandem.engine.core
import tandem.worker.drafter
import tandem.worker.model_runner
from tandem import LLM, SamplingParams
from tandem.model.llama import LlamaForCausalLM

# Greedy tiny models with a small initializer range (as in test_spec_decode.py).
TARGET = dict(initializer_range=0.05)
# Virtual seconds per forward: (fixed, per token in the batch).
TARGET_COST = (2e-3, 2e-5)
DRAFT_COST = (0.8e-3, 0.8e-5)
K = 4
PROMPT = [11, 12, 13, 14, 15, 16, 17, 18] * 2
OUTPUT_TOKENS = 160


class VirtualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def charged(monkeypatch: pytest.MonkeyPatch):
    """Runs `LLM`s on a virtual clock: every forward of the model at `draft_path` costs DRAFT_COST,
    every other forward TARGET_COST."""

    def start(draft_path: Path) -> None:
        clock = VirtualClock()
        virtual_time = SimpleNamespace(perf_counter=clock.perf_counter)
        for module in (tandem.engine.core, tandem.worker.model_runner, tandem.worker.drafter):
            monkeypatch.setattr(module, "time", virtual_time)
        forward = LlamaForCausalLM.forward

        def costed(self, batch, kv_caches):
            fixed, per_token = DRAFT_COST if Path(self.config.path) == draft_path else TARGET_COST
            clock.now += fixed + per_token * len(batch.input_ids)
            return forward(self, batch, kv_caches)

        monkeypatch.setattr(LlamaForCausalLM, "forward", costed)

    return start


def run(target: Path, draft: Path) -> LLM:
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": K}
    llm = LLM(str(target), speculative_config=spec, max_num_seqs=2, num_kv_blocks=64, num_threads=1)
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    return llm


def decode_steps(llm: LLM) -> int:
    return llm.get_stats()["engine_steps"] - 1  # the prompt took one step


def test_a_draft_that_is_always_accepted_runs(model_factory, tmp_path, charged) -> None:
    target = model_factory("llama", **TARGET)
    twin = Path(shutil.copytree(target, tmp_path / "twin"))
    charged(twin)
    llm = run(target, twin)
    spec = llm.get_stats()
    steps = decode_steps(llm)
    assert spec["spec_decode_acceptance_rate"] >= 0.95
    assert llm.engine.core.spec.controller.gate.preferred(1) is True
    # Speculation ran in nearly every step, at nearly the full k: besides the few "off" steps the
    # gate takes to compare the modes, every step drafted.
    assert spec["spec_decode_num_drafts"] >= steps - 8
    assert spec["spec_decode_num_draft_tokens"] >= (K - 1) * spec["spec_decode_num_drafts"]


def test_a_draft_that_is_never_accepted_stops(model_factory, charged) -> None:
    target = model_factory("llama", **TARGET)
    unrelated = model_factory("llama", seed=2, **TARGET)
    charged(unrelated)
    llm = run(target, unrelated)
    spec = llm.get_stats()
    steps = decode_steps(llm)
    assert spec["spec_decode_acceptance_rate"] <= 0.05
    assert llm.engine.core.spec.controller.gate.preferred(1) is False
    # The first steps draft (a new request's drafts are priced optimistically, so they get
    # measured); after that only the gate's occasional explorations of "on" do.
    assert 0 < spec["spec_decode_num_drafts"] <= 0.15 * steps
