"""Speculative decoding as `/metrics` reports it: a server with n-gram speculation counts its drafts,
draft tokens and accepted tokens consistently with the tokens it returned and the steps it ran, and
exactly as the offline engine counts them for the same request; its acceptance lengths, tree sizes and
per-method counts add up to the same; and every metric the engine's counters declare is exposed."""

from __future__ import annotations

import json

import pytest
from server_utils import FAST_ARGS, RemoteServer

from tandem import LLM, SamplingParams
from tandem.core.stats import COUNTER, declared_metrics

SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
    "adaptive": False,
}
# Repetitive: every token of the prompt's tail occurs earlier, so n-gram lookup proposes from the start.
PROMPT = "for i in range(10):\n    print(i)\n" * 4
MAX_TOKENS = 40
COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


@pytest.fixture(scope="module")
def model_dir(model_factory):
    # A small initializer range: greedy output falls into loops, which n-gram lookup predicts.
    return model_factory("llama", initializer_range=0.05)


@pytest.fixture(scope="module")
def spec_server(model_dir):
    with RemoteServer(model_dir, *FAST_ARGS, "--speculative-config", json.dumps(SPEC)) as s:
        yield s


def snapshot(server: RemoteServer) -> dict[str, float]:
    m = server.metrics()
    out = {name: m[f"tandem:spec_decode_{name}_total"] for name in COUNTERS}
    out["steps"] = m["tandem:iteration_tokens_total_count"]
    out["generation_tokens"] = m["tandem:generation_tokens_total"]
    for kind in ("draft", "accepted"):
        out[f"{kind}_by_method"] = m.get(
            f'tandem:spec_decode_num_{kind}_tokens_by_method_total{{method="ngram"}}', 0
        )
    for name in ("acceptance_length", "tree_size"):
        out[f"{name}_count"] = m[f"tandem:spec_decode_{name}_count"]
        out[f"{name}_sum"] = m[f"tandem:spec_decode_{name}_sum"]
    return out


def test_spec_decode_counters_match_usage_and_the_offline_engine(spec_server, model_dir):
    client = spec_server.client()
    before = snapshot(spec_server)
    resp = client.completions.create(
        model=str(model_dir),
        prompt=PROMPT,
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        extra_body={"ignore_eos": True},
    )
    after = snapshot(spec_server)
    delta = {k: after[k] - before[k] for k in after}
    print("metric deltas:", delta)
    k = SPEC["num_speculative_tokens"]

    assert resp.usage.completion_tokens == MAX_TOKENS == delta["generation_tokens"]
    assert delta["num_drafts"] > 0
    assert delta["num_drafts"] <= delta["num_draft_tokens"] <= k * delta["num_drafts"]
    assert 0 < delta["num_accepted_tokens"] <= delta["num_draft_tokens"]
    # One request alone: the prefill step emits one token and verifies no draft, each later step emits one
    # token plus the drafts it accepted, and verifies at most one draft.
    assert delta["steps"] + delta["num_accepted_tokens"] == MAX_TOKENS
    assert delta["num_drafts"] <= delta["steps"] - 1
    # Per method (the configured one), and one histogram observation per verification: lengths add
    # up to the drafts plus the accepted tokens, tree sizes (chains here) to the draft tokens.
    assert delta["draft_by_method"] == delta["num_draft_tokens"]
    assert delta["accepted_by_method"] == delta["num_accepted_tokens"]
    assert delta["acceptance_length_count"] == delta["tree_size_count"] == delta["num_drafts"]
    assert delta["acceptance_length_sum"] == delta["num_drafts"] + delta["num_accepted_tokens"]
    assert delta["tree_size_sum"] == delta["num_draft_tokens"]

    # The same request offline, with the same engine settings: the same text and the same counts.
    llm = LLM(str(model_dir), num_kv_blocks=128, max_num_seqs=8, num_threads=1, speculative_config=SPEC)
    out = llm.generate(
        PROMPT, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False
    )[0]
    assert resp.choices[0].text == out.outputs[0].text
    offline = llm.get_stats()
    assert {name: delta[name] for name in COUNTERS} == {
        name: offline[f"spec_decode_{name}"] for name in COUNTERS
    }


def test_every_declared_engine_metric_is_exposed(spec_server, model_dir):
    """Each field of the engine's counters (tandem/core/stats.py) is a metric in /metrics under its
    declared name: a labelled counter with a sample per label value once it counted (speculation
    ran, so each of those has counted), a histogram with its count."""
    client = spec_server.client()
    client.completions.create(
        model=str(model_dir),
        prompt=PROMPT,
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        extra_body={"ignore_eos": True},
    )
    text = spec_server.metrics_text()
    m = spec_server.metrics()
    for name, metric in declared_metrics():
        exposed = metric.exposed_name(name)
        assert text.count(f"\n# TYPE {exposed} {metric.kind}\n") == 1, name
        if metric.kind != COUNTER:
            assert m[f"{exposed}_count"] > 0, name
        elif metric.labels:
            assert any(key.startswith(exposed + "{" + metric.labels[0] + "=") for key in m), name
        else:
            assert exposed in m, name
