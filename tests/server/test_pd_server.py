"""`tandem serve --prefill-instances 1 --decode-instances 1` on Ray: every request is prefilled on
one instance and decoded on the other (its KV handed over at the first token), with the single
engine's output, and the metrics count the hand-offs, no fallback, and no prompt computed twice."""

from __future__ import annotations

import threading

import pytest
from server_utils import RemoteServer

from tandem import LLM, SamplingParams

pytest.importorskip("ray")
pytestmark = pytest.mark.slow

PROMPTS = [list(range(5, 5 + n)) for n in (3, 40, 130, 300)]


def test_prefilled_on_one_instance_decoded_on_the_other(llama_dir):
    args = ["--prefill-instances", "1", "--decode-instances", "1", "--cpus-per-instance", "0.5"]
    args += [
        "--num-threads",
        "1",
        "--num-kv-blocks",
        "512",
        "--block-size",
        "4",
        "--served-model-name",
        "tiny",
    ]
    offline = LLM(str(llama_dir), num_kv_blocks=512, num_threads=1, block_size=4)
    with RemoteServer(llama_dir, *args, startup_timeout=300) as server:
        results: dict = {}

        def send(i: int, prompt: list[int]) -> None:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
            with server.http() as http:
                results[i] = http.post("/v1/completions", json=body, timeout=120)

        threads = [threading.Thread(target=send, args=(i, p)) for i, p in enumerate(PROMPTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        for i, prompt in enumerate(PROMPTS):
            assert results[i].status_code == 200, results[i].text
            want = offline.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].text
            assert results[i].json()["choices"][0]["text"] == want, i
        m = server.metrics()
        assert m['tandem:migrations_total{outcome="completed"}'] == len(PROMPTS), m
        assert m["tandem:pd_fallbacks"] == 0
        assert m["tandem:kv_transfer_seconds_count"] == len(PROMPTS)
        assert m["tandem:migration_downtime_seconds_count"] == len(PROMPTS)
        # The decode instance took each request in with its KV: no prompt was admitted (and so
        # computed) there; every prompt token counted is the prefill instance's.
        assert m["tandem:prompt_tokens_total"] == sum(len(p) for p in PROMPTS)
        dispatched = [m[f'tandem:instance_requests_dispatched{{instance="{i}"}}'] for i in (0, 1)]
        assert dispatched[0] == len(PROMPTS)  # every request started on the prefill instance
