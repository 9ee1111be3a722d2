"""lm-eval itself against `tandem serve`: its `local-completions` model runs a multiple-choice, a
loglikelihood and a perplexity (loglikelihood_rolling) task on local data (tests/server/lm_eval_tasks,
nothing downloaded), finds the server's tokenizer through GET /tokenizer_info, and every per-document
loglikelihood it reports equals what transformers computes on the same tokens. Skipped without lm-eval
(`pip install -e ".[eval]"`: a large install, so not in the dev extra)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from server_utils import FAST_ARGS, RemoteServer

pytest.importorskip("lm_eval")
pytest.importorskip("tenacity")  # lm-eval's API models need its [api] extra

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TASKS = REPO / "tests" / "server" / "lm_eval_tasks"
MODEL = "tiny"
TOL = 1e-3  # sums of a dozen fp32 logprobs, each within 1e-4


def test_lm_eval_local_completions(llama_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # the task files name their data relative to the repository
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    import lm_eval
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(llama_dir))

    def score(ids: list[int], first: int) -> tuple[float, bool]:
        """Loglikelihood of ids[first:] given what precedes, and whether each token is the argmax."""
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
        rows = lp[first - 1 : len(ids) - 1]
        targets = torch.tensor(ids[first:])
        return rows.gather(1, targets[:, None]).sum().item(), bool((rows.argmax(-1) == targets).all())

    def pair(context: str, continuation: str) -> tuple[float, bool]:
        # lm-eval's split: trailing spaces move to the continuation; the pair is encoded whole.
        n = len(context) - len(context.rstrip())
        if n:
            context, continuation = context[:-n], context[-n:] + continuation
        ctx = tok.encode(context, add_special_tokens=False)
        whole = tok.encode(context + continuation, add_special_tokens=False)
        return score(whole, len(ctx))

    with RemoteServer(llama_dir, *FAST_ARGS, "--served-model-name", MODEL) as server:
        lm = LocalCompletionsAPI(base_url=server.url + "/v1/completions", model=MODEL)
        assert lm.tokenizer_backend == "remote"  # detected through /tokenizer_info, no Hub lookup
        results = lm_eval.simple_evaluate(
            model=lm,
            tasks=["tiny_code_mc", "tiny_code_ll", "tiny_code_ppl"],
            task_manager=TaskManager(include_path=str(TASKS)),
            log_samples=True,
            bootstrap_iters=0,  # no stderr estimates: they only cost time here
        )

    mc = results["samples"]["tiny_code_mc"]
    correct = 0
    for sample in mc:
        got = [resp[0] for resp in sample["resps"]]
        want = [pair(*args) for args in sample["arguments"]]
        for (g_ll, g_greedy), (w_ll, w_greedy) in zip(got, want):
            assert abs(g_ll - w_ll) < TOL
            assert g_greedy == w_greedy
        best = max(range(len(want)), key=lambda i: want[i][0])
        correct += best == sample["target"]
    assert len(mc) == 4
    assert results["results"]["tiny_code_mc"]["acc,none"] == pytest.approx(correct / len(mc))

    for sample in results["samples"]["tiny_code_ll"]:
        (args,) = sample["arguments"]
        (got,) = sample["resps"]
        want = pair(*args)
        assert abs(got[0][0] - want[0]) < TOL and got[0][1] == want[1]

    # lm-eval's rolling windows start with the BOS token (EOS where there is none).
    prefix = tok.convert_tokens_to_ids(tok.bos_token or tok.eos_token)
    for sample in results["samples"]["tiny_code_ppl"]:
        (text,) = sample["arguments"][0]
        ids = tok.encode(text, add_special_tokens=False)
        assert abs(sample["resps"][0][0] - score([prefix, *ids], 1)[0]) < TOL
    assert os.path.isdir(tmp_path / "datasets")  # the local data went through the test's own cache
