"""`tandem serve` through the official openai client: results equal the offline LLM's; streaming, n, stop,
echo, logprobs, usage; tokenize endpoints; a dropped stream frees its KV blocks; metrics (speculative
decoding counters at zero without speculation; with it, see test_server_fidelity.py)."""

from __future__ import annotations

import time

import pytest
from server_utils import FAST_ARGS, RemoteServer

from tandem import LLM, SamplingParams

MODEL = "tiny"
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def push(self, x):"]
GREEDY = dict(temperature=0.0, max_tokens=12)
IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def server(llama_dir):
    with RemoteServer(llama_dir, *FAST_ARGS, "--served-model-name", MODEL) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def offline(llama_dir):
    return LLM(str(llama_dir), num_kv_blocks=128, num_threads=1)


def offline_one(offline, prompt, **kw):
    return offline.generate(prompt, SamplingParams(**kw), use_tqdm=False)[0]


def test_completions_equal_offline_greedy(client, offline):
    for prompt in PROMPTS:
        resp = client.completions.create(model=MODEL, prompt=prompt, **GREEDY, extra_body=IGNORE_EOS)
        ref = offline_one(offline, prompt, **GREEDY, ignore_eos=True)
        (choice,) = resp.choices
        assert choice.text == ref.outputs[0].text
        assert choice.finish_reason == "length"
        assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert resp.usage.completion_tokens == 12
        assert resp.usage.total_tokens == len(ref.prompt_token_ids) + 12
        assert resp.model == MODEL and resp.object == "text_completion"


def test_completion_stream_equals_offline(client, offline):
    prompt = PROMPTS[0]
    ref = offline_one(offline, prompt, **GREEDY)  # EOS allowed: whatever it does, the same
    stream = client.completions.create(
        model=MODEL, prompt=prompt, stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref.outputs[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [ref.outputs[0].finish_reason]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert chunks[-1].usage.prompt_tokens == len(ref.prompt_token_ids)


def test_chat_equals_offline_streamed_and_not(client, offline):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write a loop."}]
    ref = offline.chat(messages, SamplingParams(**GREEDY, ignore_eos=True), use_tqdm=False)[0]
    resp = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY, extra_body=IGNORE_EOS)
    assert resp.choices[0].message.content == ref.outputs[0].text
    assert resp.choices[0].message.role == "assistant"
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert resp.usage.completion_tokens == 12
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            stream=True,
            max_completion_tokens=12,
            temperature=0,
            stream_options={"include_usage": True},
            extra_body=IGNORE_EOS,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.outputs[0].text
    assert chunks[-1].usage.total_tokens == len(ref.prompt_token_ids) + 12


def test_n2_seeded_samples_equal_offline(client, offline):
    kw = dict(n=2, temperature=1.0, seed=7, max_tokens=8)
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[1], **kw, extra_body=IGNORE_EOS)
    ref = offline_one(offline, PROMPTS[1], **kw, ignore_eos=True)
    assert [c.index for c in resp.choices] == [0, 1]
    assert [c.text for c in resp.choices] == [o.text for o in ref.outputs]
    assert resp.usage.completion_tokens == 16
    # Streamed, the two samples interleave by index.
    chunks = list(
        client.completions.create(model=MODEL, prompt=PROMPTS[1], stream=True, **kw, extra_body=IGNORE_EOS)
    )
    texts = ["", ""]
    for c in chunks:
        texts[c.choices[0].index] += c.choices[0].text
    assert texts == [o.text for o in ref.outputs]


def test_prompt_lists_and_token_ids(client, offline):
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[:2], **GREEDY, extra_body=IGNORE_EOS)
    refs = [offline_one(offline, p, **GREEDY, ignore_eos=True) for p in PROMPTS[:2]]
    assert [c.index for c in resp.choices] == [0, 1]
    assert [c.text for c in resp.choices] == [r.outputs[0].text for r in refs]
    ids = [r.prompt_token_ids for r in refs]
    by_ids = client.completions.create(model=MODEL, prompt=ids, **GREEDY, extra_body=IGNORE_EOS)
    assert [c.text for c in by_ids.choices] == [c.text for c in resp.choices]
    one = client.completions.create(model=MODEL, prompt=ids[0], **GREEDY, extra_body=IGNORE_EOS)
    assert one.choices[0].text == resp.choices[0].text


def test_completion_echo(client, offline):
    """echo=true: each choice's text is its prompt followed by the completion; streamed, the prompt is the
    first chunk of each choice. A prompt given as token ids is echoed as their decoded text."""
    kw = dict(model=MODEL, **GREEDY, extra_body=IGNORE_EOS)
    plain = client.completions.create(prompt=PROMPTS[:2], **kw)
    resp = client.completions.create(prompt=PROMPTS[:2], echo=True, **kw)
    assert [c.index for c in resp.choices] == [0, 1]
    assert [c.text for c in resp.choices] == [p + c.text for p, c in zip(PROMPTS, plain.choices)]
    # The echoed prompt is not counted as completion tokens (cached_tokens may differ: plain's
    # prompts are in the prefix cache by now).
    counts = lambda u: (u.prompt_tokens, u.completion_tokens, u.total_tokens)
    assert counts(resp.usage) == counts(plain.usage)

    chunks = list(client.completions.create(prompt=PROMPTS[:2], echo=True, stream=True, **kw))
    texts: dict[int, list[str]] = {0: [], 1: []}
    for c in chunks:
        texts[c.choices[0].index].append(c.choices[0].text)
    for i in (0, 1):
        assert texts[i][0] == PROMPTS[i]
        assert "".join(texts[i]) == PROMPTS[i] + plain.choices[i].text

    hf = offline.get_tokenizer()
    ids = hf.encode(PROMPTS[2])
    by_ids = client.completions.create(prompt=ids, echo=True, **kw).choices[0].text
    ref = offline_one(offline, ids, **GREEDY, ignore_eos=True).outputs[0].text
    assert by_ids == hf.decode(ids) + ref
    assert by_ids.endswith(PROMPTS[2] + ref)
    # echo with logprobs (the prompt's logprobs): test_server_prompt_logprobs.py


def test_stop_strings(client, offline):
    prompt = PROMPTS[2]
    full = offline_one(offline, prompt, temperature=0.0, max_tokens=24, ignore_eos=True).outputs[0].text
    stop = next(full[k : k + 2] for k in range(4, len(full) - 2) if full.find(full[k : k + 2]) >= 2)
    cut = full.find(stop)
    kw = dict(model=MODEL, prompt=prompt, temperature=0.0, max_tokens=24, stop=[stop], extra_body=IGNORE_EOS)
    resp = client.completions.create(**kw)
    assert resp.choices[0].text == full[:cut]
    assert resp.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
    assert streamed == full[:cut]
    kw["extra_body"] = {"ignore_eos": True, "include_stop_str_in_output": True}
    assert client.completions.create(**kw).choices[0].text == full[: cut + len(stop)]


def test_completion_logprobs(client, offline):
    kw = dict(temperature=0.0, max_tokens=6)
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[0], logprobs=3, **kw, extra_body=IGNORE_EOS)
    ref = offline_one(offline, PROMPTS[0], logprobs=3, ignore_eos=True, **kw).outputs[0]
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    for i, token in enumerate(ref.token_ids):
        assert lp.token_logprobs[i] == pytest.approx(ref.logprobs[i][token].logprob, abs=1e-4)
        assert 3 <= len(lp.top_logprobs[i]) <= 4
        # Greedy: the sampled token is the most likely one.
        assert lp.token_logprobs[i] == pytest.approx(max(lp.top_logprobs[i].values()), abs=1e-6)
    stream = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], logprobs=3, stream=True, **kw, extra_body=IGNORE_EOS
    )
    streamed = [
        t for c in stream if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens
    ]
    assert streamed == lp.tokens


def test_chat_logprobs(client):
    resp = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        logprobs=True,
        top_logprobs=2,
        temperature=0.0,
        max_tokens=5,
        extra_body=IGNORE_EOS,
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens == 5
    for entry in content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)


def test_models_tokenize_detokenize(server, offline):
    with server.http() as http:
        models = http.get("/v1/models").json()
        assert [m["id"] for m in models["data"]] == [MODEL]
        tok = http.post("/tokenize", json={"prompt": PROMPTS[0]}).json()
        assert tok["tokens"] == offline.get_tokenizer().encode(PROMPTS[0])
        assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 1024
        detok = http.post("/detokenize", json={"tokens": tok["tokens"]}).json()
        assert detok["prompt"] == offline.get_tokenizer().decode(tok["tokens"])
        assert detok["prompt"].endswith(PROMPTS[0])
        chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
        ref = offline.engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
        assert chat["tokens"] == ref


def wait_for(cond, timeout=15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    return cond()


def test_disconnect_aborts_and_frees_kv(server):
    idle = wait_for(lambda: (m := server.metrics())["tandem:num_requests_running"] == 0 and m)
    kv_before = idle["tandem:kv_cache_usage_perc"]
    aborted_before = idle.get('tandem:request_success_total{finished_reason="abort"}', 0.0)
    body = {"model": MODEL, "prompt": "while True:", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with server.http() as http, http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        got = 0
        while got < 3:
            got += next(lines).startswith("data: ")
        resp.close()  # drop the connection mid-stream
    after = wait_for(
        lambda: (
            (m := server.metrics())["tandem:num_requests_running"] == 0
            and m["tandem:kv_cache_usage_perc"] == kv_before
            and m
        )
    )
    assert after, server.metrics()
    # Counted as aborted (a request that ran to its end would count as "length").
    assert after['tandem:request_success_total{finished_reason="abort"}'] == aborted_before + 1
    assert server.proc.poll() is None


def test_metrics_exposed(server, client):
    client.completions.create(model=MODEL, prompt="x = 1", max_tokens=4, extra_body=IGNORE_EOS)
    m = server.metrics()
    for name in [
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "inter_token_latency_seconds",
        "iteration_tokens_total",
    ]:
        assert m[f"tandem:{name}_count"] > 0, name
    assert m["tandem:prompt_tokens_total"] > 0
    assert m["tandem:generation_tokens_total"] >= 4
    assert m["tandem:prefix_cache_queries_total"] >= m["tandem:prefix_cache_hits_total"]
    assert m['tandem:request_success_total{finished_reason="length"}'] >= 1
    assert m['tandem:tenant_requests_total{outcome="finished",tenant="default"}'] >= 1
    assert "tandem:num_preemptions_total" in m
    assert "tandem:num_requests_waiting" in m
    # Busy time: at least the four decode steps ran, each taking some time.
    assert m["tandem:engine_steps_total"] >= 4 and m["tandem:engine_step_seconds_total"] > 0


def test_spec_decode_counters_stay_zero_without_speculation(server, client):
    client.completions.create(
        model=MODEL, prompt="x = 1\nx = 1\nx = 1\n", max_tokens=4, extra_body=IGNORE_EOS
    )
    m = server.metrics()
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert m[f"tandem:spec_decode_{name}_total"] == 0, name
