"""vLLM's surface beyond plain completions, end to end with the official openai SDK (httpx where it has
no method) against one `tandem serve` started with vLLM's flags: token-level sampling controls,
best_of, suffix, cache_salt, truncate_prompt_tokens, return_tokens_as_token_ids, the chat template
options, /tokenize's token strings, GET /v1/models/{id}, /version, /ping, several served names,
--generation-config, --max-logprobs, --response-role; and `tandem bench serve` without --model."""

from __future__ import annotations

import json
import subprocess
import sys

import openai
import pytest
from server_utils import FAST_ARGS, RemoteServer

NAMES = ["tiny", "tiny-alias"]
PROMPT = "def fibonacci(n):"
MAX_LOGPROBS = 5

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def gen_config(tmp_path_factory):
    folder = tmp_path_factory.mktemp("genconfig")
    # Greedy unless a request says otherwise: the server's default temperature comes from here.
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "top_k": 5}))
    return folder


@pytest.fixture(scope="module")
def server(llama_dir, gen_config):
    vllm_flags = [
        "--served-model-name", *NAMES,
        "--generation-config", str(gen_config),
        "--max-logprobs", str(MAX_LOGPROBS),
        "--response-role", "bot",
        "--enable-prefix-caching", "--enable-chunked-prefill", "--trust-remote-code",
        "--gpu-memory-utilization", "0.9", "--tensor-parallel-size", "1", "--disable-log-requests",
        "--starvation-timeout-s", "10", "--tenant-quotas", "{}",
    ]  # fmt: skip
    with RemoteServer(llama_dir, *FAST_ARGS, *vllm_flags) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def http(server):
    with server.http() as h:
        yield h


def token_ids(choice) -> list[int]:
    """A completion choice's token ids, from logprobs written with return_tokens_as_token_ids."""
    return [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]


def complete(client, **kw):
    body = {"ignore_eos": True, "return_tokens_as_token_ids": True, **kw.pop("extra_body", {})}
    kw.setdefault("max_tokens", 8)
    return client.completions.create(model=NAMES[0], prompt=PROMPT, logprobs=0, extra_body=body, **kw)


def test_return_tokens_as_token_ids(client, http):
    choice = complete(client).choices[0]
    assert all(t.startswith("token_id:") for t in choice.logprobs.tokens)
    ids = token_ids(choice)
    text = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert text == choice.text


def test_logit_bias_forces_a_token_and_bad_keys_are_400(client):
    assert token_ids(complete(client, logit_bias={"77": 100}).choices[0]) == [77] * 8
    with pytest.raises(openai.BadRequestError) as err:
        complete(client, logit_bias={"seventy": 5})
    assert err.value.body["param"] == "logit_bias"
    with pytest.raises(openai.BadRequestError) as err:
        complete(client, logit_bias={"77": 101})
    assert err.value.body["param"] == "logit_bias"


def test_allowed_token_ids_sampled(client):
    allowed = [11, 12, 13, 40]
    choice = complete(client, temperature=1.0, seed=3, max_tokens=16, extra_body={"allowed_token_ids": allowed})
    assert set(token_ids(choice.choices[0])) <= set(allowed)


def test_bad_words_never_appear(client, http):
    plain = token_ids(complete(client).choices[0])
    word = http.post("/detokenize", json={"tokens": [plain[0]]}).json()["prompt"].strip()
    assert word
    banned = http.post("/tokenize", json={"prompt": word, "add_special_tokens": False}).json()["tokens"]
    got = token_ids(complete(client, extra_body={"bad_words": [word]}).choices[0])
    assert got != plain
    assert not any(got[i : i + len(banned)] == banned for i in range(len(got)))


def test_best_of_returns_the_best_by_cumulative_logprob(client):
    kw = dict(temperature=1.0, seed=11, max_tokens=6)
    every = complete(client, n=3, **kw)
    scores = [sum(c.logprobs.token_logprobs) for c in every.choices]
    best = complete(client, n=1, best_of=3, **kw)
    (choice,) = best.choices
    assert choice.index == 0
    assert choice.text == every.choices[scores.index(max(scores))].text
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=NAMES[0], prompt=PROMPT, best_of=2, stream=True, max_tokens=4)
    assert err.value.body["param"] == "best_of"


def test_suffix_without_fim_tokens_is_400_saying_why(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=NAMES[0], prompt=PROMPT, suffix="    return n", max_tokens=4)
    assert err.value.body["param"] == "suffix"
    assert "fill-in-the-middle" in err.value.body["message"]


def test_cache_salt_separates_prefix_cache(client, server):
    prompt = "import os\nimport sys\n" * 8  # several full blocks

    def hits_after(salt: str) -> float:
        before = server.metrics()["tandem:prefix_cache_hits_total"]
        client.completions.create(model=NAMES[0], prompt=prompt, max_tokens=1, extra_body={"cache_salt": salt})
        return server.metrics()["tandem:prefix_cache_hits_total"] - before

    assert hits_after("tenant-a") == 0
    assert hits_after("tenant-a") > 0
    assert hits_after("tenant-b") == 0


def test_truncate_prompt_tokens(client, http):
    full = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    resp = complete(client, extra_body={"truncate_prompt_tokens": 3})
    assert resp.usage.prompt_tokens == 3
    ref = client.completions.create(model=NAMES[0], prompt=full[-3:], max_tokens=8, extra_body={"ignore_eos": True})
    assert resp.choices[0].text == ref.choices[0].text


def test_tokenize_token_strs_and_chat_options(http):
    resp = http.post("/tokenize", json={"prompt": PROMPT, "return_token_strs": True}).json()
    assert len(resp["token_strs"]) == len(resp["tokens"]) and "".join(resp["token_strs"]).startswith("def")
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "def f"}]
    with_gen = http.post("/tokenize", json={"messages": msgs[:1]}).json()["tokens"]
    without = http.post("/tokenize", json={"messages": msgs[:1], "add_generation_prompt": False}).json()["tokens"]
    assert len(with_gen) > len(without) and with_gen[: len(without)] == without
    closed = http.post("/tokenize", json={"messages": msgs, "add_generation_prompt": False}).json()["tokens"]
    open_ = http.post(
        "/tokenize", json={"messages": msgs, "add_generation_prompt": False, "continue_final_message": True}
    ).json()["tokens"]
    # The final message is left open: no end-of-turn after its text.
    assert len(open_) < len(closed) and closed[: len(open_)] == open_


def test_chat_add_generation_prompt_continue_final_message_and_role(client, http):
    msgs = [{"role": "user", "content": "Write a loop."}]
    on = client.chat.completions.create(model=NAMES[1], messages=msgs, max_tokens=4)
    off = client.chat.completions.create(
        model=NAMES[1], messages=msgs, max_tokens=4, extra_body={"add_generation_prompt": False}
    )
    assert on.usage.prompt_tokens > off.usage.prompt_tokens
    assert on.choices[0].message.role == "bot"  # --response-role
    assert off.choices[0].message.role == "user"  # no generation prompt: the last message's role
    cont = client.chat.completions.create(
        model=NAMES[0],
        messages=[*msgs, {"role": "assistant", "content": "for i in"}],
        max_tokens=4,
        extra_body={"add_generation_prompt": False, "continue_final_message": True, "chat_template_kwargs": {"x": 1}},
    )
    assert cont.choices[0].finish_reason in ("length", "stop")
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=NAMES[0], messages=msgs, max_tokens=4, extra_body={"chat_template_kwargs": {"tokenize": True}}
        )
    assert err.value.body["param"] == "chat_template_kwargs"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=NAMES[0], messages=msgs, max_tokens=4, extra_body={"continue_final_message": True}
        )
    assert err.value.body["param"] == "continue_final_message"


def test_served_names_and_models_retrieve(client):
    assert [m.id for m in client.models.list().data] == NAMES
    for name in NAMES:
        assert client.models.retrieve(name).id == name
        assert client.completions.create(model=name, prompt=PROMPT, max_tokens=2).model == NAMES[0]
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("no-such-model")
    assert err.value.body["code"] == "model_not_found"


def test_version_ping_openapi_docs(http):
    from tandem import __version__

    assert http.get("/version").json() == {"version": __version__}
    assert http.get("/ping").status_code == 200 and http.post("/ping").status_code == 200
    spec = http.get("/openapi.json").json()
    assert {"/v1/models/{model_id}", "/version", "/ping"} <= set(spec["paths"])
    assert http.get("/docs").status_code == 200


def test_generation_config_defaults_and_max_logprobs(client):
    # temperature unset: the generation config's 0 applies, so unseeded requests agree with greedy.
    kw = dict(model=NAMES[0], prompt=PROMPT, max_tokens=8, extra_body={"ignore_eos": True})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    greedy = client.completions.create(temperature=0, **kw)
    assert a.choices[0].text == b.choices[0].text == greedy.choices[0].text
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=NAMES[0], prompt=PROMPT, max_tokens=2, logprobs=MAX_LOGPROBS + 1)
    assert err.value.body["param"] == "logprobs"


@pytest.mark.slow
def test_bench_serve_reads_the_model_and_plots(server, tokenizer_dir, tmp_path):
    out, plots = tmp_path / "result.json", tmp_path / "plots"
    proc = subprocess.run(
        [
            sys.executable, "-m", "tandem.entrypoints.cli", "bench", "serve", "--base-url", server.url,
            "--tokenizer", str(tokenizer_dir), "--num-prompts", "2", "--input-len", "8", "--output-len", "4",
            "--ignore-eos", "--max-concurrency", "1,2", "--result-json", str(out), "--plot", str(plots),
            "--disable-tqdm",
        ],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["model"] == NAMES[0]
    assert [r["max_concurrency"] for r in result["runs"]] == [1, 2]
    assert (plots / "throughput_vs_latency.png").stat().st_size > 0
