"""Prompt logprobs over HTTP, as vLLM serves them: completions' echo + logprobs (lm-eval's
loglikelihood request) and `max_tokens: 0`, the `prompt_logprobs` field on completions and chat,
`usage.prompt_tokens_details.cached_tokens`, and GET /tokenizer_info. Values are checked against
transformers' log-softmax of the prompt positions."""

from __future__ import annotations

import pytest
import torch
from server_utils import FAST_ARGS, RemoteServer

MODEL = "tiny"
TOL = 1e-4
TEXTS = ["def fibonacci(n):\n    return n", "import os\nimport sys\nprint(sys.argv)"]


@pytest.fixture(scope="module")
def server(llama_dir):
    with RemoteServer(llama_dir, *FAST_ARGS, "--served-model-name", MODEL, "--block-size", "4") as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with server.http() as h:
        yield h


@pytest.fixture(scope="module")
def hf(llama_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(llama_dir))


def reference(hf, ids: list[int]) -> torch.Tensor:
    """Row j: the log-softmax after prompt position j (predicting token j + 1)."""
    with torch.no_grad():
        return torch.log_softmax(hf[0](torch.tensor([ids])).logits[0].float(), dim=-1)


def post(http, path: str, body: dict) -> dict:
    resp = http.post(path, json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_echo_logprobs_as_lm_eval_sends_them(http, hf):
    tok = hf[1]
    prompts = [tok.encode(t) for t in TEXTS]
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 1, "logprobs": 1, "echo": True,
            "temperature": 0, "seed": 1234}  # fmt: skip
    out = post(http, "/v1/completions", body)
    choices = sorted(out["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1]
    for ids, choice in zip(prompts, choices):
        ref = reference(hf, ids)
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + 1  # the prompt, then the generated token
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for j in range(1, len(ids)):
            assert abs(lp["token_logprobs"][j] - ref[j - 1, ids[j]].item()) < TOL
            top = lp["top_logprobs"][j]
            assert abs(max(top.values()) - ref[j - 1].max().item()) < TOL
            assert lp["tokens"][j] == tok.decode([ids[j]])
        generated = int(ref[-1].argmax())
        assert abs(lp["token_logprobs"][-1] - ref[-1, generated].item()) < TOL
        assert lp["text_offset"] == sorted(lp["text_offset"])
        assert choice["text"] == tok.decode(ids) + tok.decode([generated])
        # vLLM's prompt_logprobs come along: None, then {token id: {logprob, rank, decoded_token}}.
        pl = choice["prompt_logprobs"]
        assert pl[0] is None and len(pl) == len(ids)
        entry = pl[1][str(ids[1])]
        assert set(entry) == {"logprob", "rank", "decoded_token"}
        assert abs(entry["logprob"] - ref[0, ids[1]].item()) < TOL
        assert entry["rank"] == int((ref[0] > ref[0, ids[1]]).sum()) + 1
    assert out["usage"]["completion_tokens"] == 2


def test_max_tokens_zero_with_echo_returns_the_prompt_only(http, hf):
    tok = hf[1]
    ids = tok.encode(TEXTS[0])
    ref = reference(hf, ids)
    out = post(http, "/v1/completions", {"model": MODEL, "prompt": TEXTS[0], "max_tokens": 0, "echo": True,
                                         "logprobs": 0})  # fmt: skip
    (choice,) = out["choices"]
    assert choice["text"] == TEXTS[0]
    assert choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids)
    got = torch.tensor(lp["token_logprobs"][1:])
    want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert torch.allclose(got, want, atol=TOL)
    assert out["usage"]["completion_tokens"] == 0 and out["usage"]["prompt_tokens"] == len(ids)
    # Without echo there is nothing to return: refused, as vLLM does.
    resp = http.post("/v1/completions", json={"model": MODEL, "prompt": TEXTS[0], "max_tokens": 0})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_tokens"


def test_prompt_logprobs_field_completions_and_chat(server, hf):
    tok = hf[1]
    client = server.client()
    ids = tok.encode(TEXTS[1])
    ref = reference(hf, ids)
    resp = client.completions.create(
        model=MODEL, prompt=TEXTS[1], max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    pl = resp.choices[0].prompt_logprobs
    assert resp.choices[0].logprobs is None
    assert pl[0] is None and len(pl) == len(ids)
    for j in range(1, len(ids)):
        entry = pl[j]
        assert str(ids[j]) in entry and len(entry) in (2, 3)
        for tid, v in entry.items():
            assert abs(v["logprob"] - ref[j - 1, int(tid)].item()) < TOL

    messages = [{"role": "user", "content": "Write a loop."}]
    chat_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    chat_ids = tok.encode(chat_ids, add_special_tokens=False)
    ref = reference(hf, chat_ids)
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 0}
    )
    pl = chat.prompt_logprobs
    assert pl[0] is None and len(pl) == len(chat_ids) == chat.usage.prompt_tokens
    for j in range(1, len(chat_ids)):
        (only,) = pl[j].items()
        assert only[0] == str(chat_ids[j])
        assert abs(only[1]["logprob"] - ref[j - 1, chat_ids[j]].item()) < TOL


def test_usage_reports_cached_prompt_tokens(server):
    client = server.client()
    prompt = "class Queue:\n    def __init__(self):\n        self.items = []\n" * 3
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    n = second.usage.prompt_tokens
    # Whole blocks of 4, always leaving the last prompt token to compute.
    assert second.usage.prompt_tokens_details.cached_tokens == (n - 1) // 4 * 4 > 0
    # A request asking for prompt logprobs computes its whole prompt (the cache holds no logits).
    scored = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body={"prompt_logprobs": 0})
    assert scored.usage.prompt_tokens_details.cached_tokens == 0
    messages = [{"role": "user", "content": prompt}]
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=1, stream=True, stream_options={"include_usage": True}
    )
    last = list(stream)[-1]
    assert last.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens_details.cached_tokens


def test_tokenizer_info(http, hf, llama_dir):
    tok = hf[1]
    resp = http.get("/tokenizer_info")
    assert resp.status_code == 200
    info = resp.json()
    assert info["tokenizer_class"] == type(tok).__name__
    assert info["eos_token"] == tok.eos_token and info["bos_token"] == tok.bos_token
    assert info["chat_template"] == tok.chat_template
    assert info["model_max_length"] == tok.model_max_length
    assert str(llama_dir) not in resp.text  # no filesystem path leaves the server


def test_streamed_echo_with_logprobs_equals_the_whole_response(server):
    client = server.client()
    kw = dict(model=MODEL, prompt=TEXTS[:2], max_tokens=3, temperature=0, echo=True, logprobs=1)
    whole = client.completions.create(**kw, extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(**kw, stream=True, extra_body={"ignore_eos": True}))
    for choice in whole.choices:
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert mine[0].text == TEXTS[choice.index]  # the prompt first, with its logprobs
        assert mine[0].logprobs.token_logprobs[0] is None
        assert "".join(c.text for c in mine) == choice.text
        lps = [v for c in mine if c.logprobs for v in c.logprobs.token_logprobs]
        # Within float32 noise: the two runs batch the prompts differently.
        assert lps[0] is None and choice.logprobs.token_logprobs[0] is None
        assert lps[1:] == pytest.approx(choice.logprobs.token_logprobs[1:], abs=1e-4)
        offsets = [v for c in mine if c.logprobs for v in c.logprobs.text_offset]
        assert offsets == choice.logprobs.text_offset
        assert mine[-1].finish_reason == "length"

    kw.update(max_tokens=0, prompt=TEXTS[0])
    whole = client.completions.create(**kw)
    chunks = [c.choices[0] for c in client.completions.create(**kw, stream=True) if c.choices]
    assert "".join(c.text for c in chunks) == TEXTS[0] == whole.choices[0].text
    assert [v for c in chunks if c.logprobs for v in c.logprobs.token_logprobs] == whole.choices[0].logprobs.token_logprobs
    assert chunks[-1].finish_reason == "length"
