"""The embedded default model and its draft: shipped, loadable by transformers and Tandem alike."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.checkpoints import DEFAULT_MODEL_DIR, default_model_path

DRAFT_DIR = DEFAULT_MODEL_DIR.parent / "default-draft"
PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef main():\n", "class Stack:\n    def __init__(self):\n"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM()  # no model argument: the embedded default


def test_default_model_is_the_shipped_one(llm):
    assert default_model_path() == str(DEFAULT_MODEL_DIR)
    assert llm.engine.model_config.architecture == "LlamaForCausalLM"
    assert (DRAFT_DIR / "config.json").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("path", [DEFAULT_MODEL_DIR, DRAFT_DIR])
def test_greedy_matches_transformers(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    # min_tokens, as transformers' min_new_tokens: EOS is masked out, not merely not stopped at.
    ours = LLM(str(path)).generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=32, min_tokens=32), use_tqdm=False
    )
    for prompt, out in zip(PROMPTS, ours):
        ids = torch.tensor([tok.encode(prompt)])
        with torch.no_grad():
            ref = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=32,
                min_new_tokens=32,
                do_sample=False,
                pad_token_id=0,
            )
        assert out.outputs[0].token_ids == ref[0, ids.shape[1] :].tolist()


@pytest.mark.slow
def test_cli_generate_without_model_prints_python():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tandem.entrypoints.cli",
            "generate",
            "--prompt",
            "def fibonacci(n):",
            "--max-tokens",
            "48",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert text.startswith("def fibonacci(n):")
    body = text[len("def fibonacci(n):") :]
    # A plausible continuation: an indented block with Python keywords or names.
    assert "\n    " in body
    assert any(word in body for word in ("return", "if ", "for ", "n", "self", "="))


@pytest.mark.slow
def test_draft_accepts_on_code(llm):
    spec = {"method": "draft_model", "model": str(DRAFT_DIR), "num_speculative_tokens": 4, "adaptive": False}
    sp_llm = LLM(speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    base = llm.generate(PROMPTS, params, use_tqdm=False)
    outs = sp_llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in base]
    stats = sp_llm.get_stats()
    assert stats["spec_decode_num_draft_tokens"] > 0
    assert stats["spec_decode_acceptance_rate"] > 0.2


def test_step_time_breakdown(llm):
    """The stats split step time into the model forward and the engine's own overhead."""
    before = llm.get_stats()
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    after = llm.get_stats()
    steps = after["engine_steps"] - before["engine_steps"]
    step_time = after["engine_step_seconds"] - before["engine_step_seconds"]
    forward = after["engine_forward_seconds"] - before["engine_forward_seconds"]
    assert steps >= 8
    assert 0 < forward < step_time
    assert after["engine_draft_seconds"] == 0.0
    assert 0.0 < after["engine_overhead_fraction"] < 1.0
