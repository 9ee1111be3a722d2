"""Speculation's metrics (tandem/core/stats.py): the acceptance length and tree size histograms and
accepted/proposed per method, counted by the planner under the method's name from
speculative_config, and exposed as such by the server's metrics."""

from __future__ import annotations

from dataclasses import replace

from tandem import LLM, SamplingParams
from tandem.core.request import Request
from tandem.core.stats import EngineCounters
from tandem.engine.messages import Stats
from tandem.entrypoints.openai.metrics import ServerMetrics
from tandem.sampling_params import SamplingParams as Params
from tandem.spec.config import SpeculativeConfig
from tandem.spec.planner import SpecPlanner


def weighted_sum(hist: dict[int, int]) -> int:
    return sum(value * times for value, times in hist.items())


def check_consistent(c: EngineCounters, method: str, k: int, before: EngineCounters | None = None) -> None:
    """Every verification since `before` (the previous report) is one histogram observation of each
    kind, and the histograms add up to the counters' increase: acceptance lengths to drafts plus
    accepted tokens, tree sizes to draft tokens."""
    b = before or EngineCounters()
    drafts = c.spec_decode_num_drafts - b.spec_decode_num_drafts
    proposed = c.spec_decode_num_draft_tokens - b.spec_decode_num_draft_tokens
    accepted = c.spec_decode_num_accepted_tokens - b.spec_decode_num_accepted_tokens
    assert drafts > 0
    assert c.spec_decode_num_draft_tokens_by_method == {method: c.spec_decode_num_draft_tokens}
    assert c.spec_decode_num_accepted_tokens_by_method == {method: c.spec_decode_num_accepted_tokens}
    lengths, sizes = c.spec_decode_acceptance_length, c.spec_decode_tree_size
    assert sum(lengths.values()) == sum(sizes.values()) == drafts
    assert weighted_sum(lengths) == drafts + accepted
    assert weighted_sum(sizes) == proposed
    assert min(lengths) >= 1 and max(lengths) <= k + 1
    assert min(sizes) >= 1 and max(sizes) <= k
    assert sum(c.spec_decode_num_accepted_tokens_per_pos.values()) == c.spec_decode_num_accepted_tokens


def mean(hist: dict[int, int]) -> float:
    return weighted_sum(hist) / sum(hist.values())


def exposed(c: EngineCounters) -> ServerMetrics:
    metrics = ServerMetrics("m")
    metrics.observe_stats(Stats(0, 0, 0.0, c))
    return metrics


def test_suffix_metrics_move_with_what_the_drafts_find(model_factory):
    """The same request twice with suffix speculation: the first drafts from its own short history,
    the second from the first's whole output, so its acceptance lengths are long, its drafts trees
    of several nodes, and all of it is counted under method "suffix"."""
    model_dir = model_factory("llama")
    k = 8
    llm = LLM(
        str(model_dir),
        speculative_config={"method": "suffix", "num_speculative_tokens": k, "adaptive": False},
        num_threads=1,
        max_num_seqs=2,
    )
    prompt = {"prompt_token_ids": list(range(20, 44))}
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    counters = llm.engine.counters
    llm.generate([prompt], params, use_tqdm=False)
    first = counters.take()  # as the engine loop reports: the histograms start afresh
    assert counters.spec_decode_acceptance_length == {} and counters.spec_decode_tree_size == {}
    check_consistent(first, "suffix", k)
    llm.generate([prompt], params, use_tqdm=False)
    second = counters.take()
    # The cumulative counters went on from the first report; the histograms hold the second run's.
    check_consistent(second, "suffix", k, before=first)
    run1, run2 = first.spec_decode_acceptance_length, second.spec_decode_acceptance_length
    assert mean(run2) >= 4 and mean(run2) > mean(run1)
    assert max(second.spec_decode_tree_size) > 1

    metrics = exposed(second)
    value = metrics.registry.get_sample_value
    labels = {"model_name": "m", "method": "suffix"}
    assert (
        value("tandem:spec_decode_num_draft_tokens_by_method_total", labels)
        == second.spec_decode_num_draft_tokens
    )
    assert (
        value("tandem:spec_decode_num_accepted_tokens_by_method_total", labels)
        == second.spec_decode_num_accepted_tokens
    )
    assert value("tandem:spec_decode_acceptance_length_count", {"model_name": "m"}) == sum(run2.values())
    assert value("tandem:spec_decode_acceptance_length_sum", {"model_name": "m"}) == weighted_sum(run2)
    assert value("tandem:spec_decode_tree_size_sum", {"model_name": "m"}) == weighted_sum(
        second.spec_decode_tree_size
    )


def test_ngram_metrics_count_chains_under_ngram(model_factory):
    """n-gram lookup over a looping output: chains of at most k tokens (a chain of k is a k-node
    tree), counted under method "ngram"; with prefix lookups of one to three tokens, most accepted."""
    model_dir = model_factory("llama", initializer_range=0.05)
    k = 3
    spec = {
        "method": "ngram",
        "num_speculative_tokens": k,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
        "adaptive": False,
    }
    llm = LLM(str(model_dir), speculative_config=spec, num_threads=1)
    prompt = "for i in range(10):\n    print(i)\n" * 4
    llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    c = llm.engine.counters.take()
    check_consistent(c, "ngram", k)
    assert c.spec_decode_acceptance_length.get(k + 1, 0) > 0  # whole chains were accepted
    value = exposed(c).registry.get_sample_value
    labels = {"model_name": "m", "method": "ngram"}
    assert (
        value("tandem:spec_decode_num_draft_tokens_by_method_total", labels) == c.spec_decode_num_draft_tokens
    )
    # Every chain fits the bucket of k nodes.
    drafts = c.spec_decode_num_drafts
    assert value("tandem:spec_decode_tree_size_bucket", {"model_name": "m", "le": f"{float(k)}"}) == drafts


def test_the_method_label_is_the_configured_method():
    """Any method speculative_config names (draft heads included) is counted under that name, with
    nothing to add for it."""
    base = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4, "adaptive": False})
    assert base is not None
    for method in ("ngram", "medusa", "eagle"):
        planner = SpecPlanner(replace(base, method=method))
        req = Request("r", [1, 2, 3], Params(max_tokens=8), 8)
        planner.observe(req, 4, 2)
        planner.observe(req, 3, 0)
        c = planner.counters
        assert c.spec_decode_num_draft_tokens_by_method == {method: 7}
        assert c.spec_decode_num_accepted_tokens_by_method == {method: 2}
        assert c.spec_decode_acceptance_length == {3: 1, 1: 1}
        assert c.spec_decode_tree_size == {4: 1, 3: 1}
        assert c.spec_decode_num_accepted_tokens_per_pos == {"0": 1, "1": 1}
