"""lm-eval's `local-completions` against `tandem serve` on the real SmolLM2-135M-Instruct Q4_1 (the
pulled model: tests/conftest.py's smollm2_gguf) with `--dtype float32`, on the 205-question task
tests/server/lm_eval_tasks/general_knowledge_mc.yaml: the accuracy lm-eval reports is the one
transformers gets reading the same file (each question's answer computed here from transformers'
loglikelihoods). Skipped without lm-eval (`pip install -e ".[eval]"`) or the model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from server_utils import RemoteServer

pytest.importorskip("lm_eval")
pytest.importorskip("tenacity")  # lm-eval's API models need its [api] extra

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TASKS = REPO / "tests" / "server" / "lm_eval_tasks"
TASK = "general_knowledge_mc"
MODEL = "smollm2-135m-instruct"


def transformers_accuracy(gguf: Path) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    items = [json.loads(line) for line in (TASKS / "general_knowledge.jsonl").read_text().splitlines()]
    right = 0
    for item in items:
        context = f"Question: {item['question']}\nAnswer:"
        ctx = tok.encode(context, add_special_tokens=False)
        scores = []
        for choice in item["choices"]:
            ids = tok.encode(f"{context} {choice}", add_special_tokens=False)
            with torch.no_grad():
                lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
            scores.append(sum(lp[k - 1, ids[k]].item() for k in range(len(ctx), len(ids))))
        right += max(range(len(scores)), key=scores.__getitem__) == item["answer"]
    return right / len(items)


def test_lm_eval_accuracy_equals_transformers(smollm2_gguf, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # the task names its data relative to the repository
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    import lm_eval
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    args = ["--dtype", "float32", "--num-kv-blocks", "512", "--served-model-name", MODEL]
    with RemoteServer(smollm2_gguf, *args) as server:
        lm = LocalCompletionsAPI(base_url=server.url + "/v1/completions", model=MODEL)
        results = lm_eval.simple_evaluate(
            model=lm, tasks=[TASK], task_manager=TaskManager(include_path=str(TASKS)), bootstrap_iters=0
        )
    accuracy = results["results"][TASK]["acc,none"]
    assert accuracy == pytest.approx(transformers_accuracy(smollm2_gguf))
    assert accuracy > 0.5  # a trained model: far above chance (0.25)
