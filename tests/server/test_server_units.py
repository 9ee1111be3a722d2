"""In-process pieces of the server: the wire codec, metrics bookkeeping, error shaping (no subprocess)."""

from __future__ import annotations

from tandem.core.limits import EngineLimits
from tandem.core.stats import EngineCounters, declared_metrics
from tandem.core.step_io import SampledLogprobs
from tandem.engine import messages as m
from tandem.engine.messages import EngineCoreRequest, SampleOutput
from tandem.entrypoints.openai.errors import validation_error
from tandem.entrypoints.openai.metrics import ServerMetrics
from tandem.sampling_params import SamplingParams


def test_messages_round_trip():
    params = SamplingParams(n=2, temperature=0.5, seed=3, stop="\n", stop_token_ids=[7], logprobs=2)
    req = EngineCoreRequest("r", [1, 2, 3], params, 9, 12.5, priority=2, tenant="t", cache_salt="s")
    out = SampleOutput("r", 1, [4, 5], [SampledLogprobs(-0.1, 1, [4], [-0.1])] * 2, "stop", "\n")
    counters = EngineCounters(num_preemptions=3, prefix_cache_queries=40, prefix_cache_hits=16)
    counters.spec_decode_num_draft_tokens_by_method["ngram"] = 7
    counters.iteration_tokens.update({8: 1, 1: 2})
    counters.engine_step_seconds = 0.25
    stats = m.Stats(1, 2, 0.5, counters)
    sent = [
        m.Init([2]),
        m.Add(req),
        m.Abort(["r"]),
        m.StopSample("r", 1, "\n"),
        m.Shutdown(),
        m.Hello(5),
        m.Ready(5, EngineLimits(512, 1024, 16, 64, 8)),
        m.Outputs([out], stats),
        m.Rejected("r", "bad"),
        m.Failed("boom"),
    ]
    enc, to_engine, to_client = m.encoder(), m.engine_decoder(), m.client_decoder()
    for i, msg in enumerate(sent):
        dec = to_engine if i < 5 else to_client
        assert dec.decode(enc.encode(msg)) == msg
    assert to_engine.decode(enc.encode(m.Add(req))).request.params.stop == ["\n"]


def test_metrics_turn_cumulative_stats_into_increments():
    metrics = ServerMetrics("tiny")

    def counters(queries: int, hits: int, generated: int, steps: dict[int, int]) -> EngineCounters:
        return EngineCounters(
            prompt_tokens=queries,
            generation_tokens=generated,
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
            num_preemptions=1,
            iteration_tokens=steps,
        )

    metrics.observe_stats(m.Stats(2, 1, 0.25, counters(100, 32, 5, {64: 1, 2: 1})))
    metrics.observe_stats(m.Stats(0, 0, 0.0, counters(150, 48, 9, {3: 1})))
    text = metrics.render()[0].decode()
    assert 'tandem:prefix_cache_queries_total{model_name="tiny"} 150.0' in text
    assert 'tandem:prefix_cache_hits_total{model_name="tiny"} 48.0' in text
    assert 'tandem:generation_tokens_total{model_name="tiny"} 9.0' in text
    assert 'tandem:num_preemptions_total{model_name="tiny"} 1.0' in text
    assert 'tandem:num_requests_running{model_name="tiny"} 0.0' in text
    assert 'tandem:iteration_tokens_total_count{model_name="tiny"} 3.0' in text
    # A second server in the same process has its own registry.
    assert "150.0" not in ServerMetrics("tiny").render()[0].decode()


def test_every_declared_engine_metric_is_registered_once():
    """The engine's metrics come from tandem/core/stats.py's declarations, each under its name and
    kind; a labelled counter gets a sample per label value it counted."""
    metrics = ServerMetrics("tiny")
    counters = EngineCounters(prefix_cache_hits=3)
    counters.spec_decode_num_accepted_tokens_by_method["suffix"] = 5
    metrics.observe_stats(m.Stats(0, 0, 0.0, counters))
    text = metrics.render()[0].decode()
    for name, metric in declared_metrics():
        assert text.count(f"\n# TYPE {metric.exposed_name(name)} {metric.kind}\n") == 1, name
    assert 'tandem:prefix_cache_hits_total{model_name="tiny"} 3.0' in text
    assert (
        'tandem:spec_decode_num_accepted_tokens_by_method_total{method="suffix",model_name="tiny"} 5.0'
        in text
    )


def test_a_gone_instance_leaves_the_gauges_and_keeps_its_counts():
    metrics = ServerMetrics("tiny")
    metrics.observe_stats(m.Stats(2, 1, 0.5, EngineCounters(generation_tokens=4)), instance=0)
    metrics.observe_stats(m.Stats(3, 0, 0.25, EngineCounters(generation_tokens=6)), instance=1)
    text = metrics.render()[0].decode()
    assert 'tandem:num_requests_running{model_name="tiny"} 5.0' in text
    assert 'tandem:instance_num_requests_running{instance="1",model_name="tiny"} 3.0' in text
    metrics.forget_instance(1)
    metrics.forget_instance(1)  # a second notice (retired, then its process exits) is harmless
    text = metrics.render()[0].decode()
    assert 'tandem:num_requests_running{model_name="tiny"} 2.0' in text
    assert 'tandem:kv_cache_usage_perc{model_name="tiny"} 0.5' in text
    assert 'instance="1"' not in text
    assert 'tandem:generation_tokens_total{model_name="tiny"} 10.0' in text
    metrics.forget_instance(0)
    assert 'tandem:num_requests_running{model_name="tiny"} 0.0' in metrics.render()[0].decode()


def test_validation_errors_name_the_field():
    err = validation_error(
        [
            {
                "type": "string_type",
                "loc": ("body", "prompt", "str"),
                "msg": "Input should be a valid string",
            },
            {
                "type": "list_type",
                "loc": ("body", "prompt", "list[str]"),
                "msg": "Input should be a valid list",
            },
        ]
    )
    assert err.status == 400 and err.param == "prompt"
    err = validation_error([{"type": "literal_error", "loc": ("body", "messages", 0, "role"), "msg": "bad"}])
    assert err.param == "messages[0].role"
    assert validation_error([{"type": "json_invalid", "loc": ("body", 1), "msg": "x"}]).param is None
