"""Prometheus metrics of one server instance, named as vLLM's with the `tandem:` prefix.

Each `ServerMetrics` owns its registry, so several servers (or tests) in one process never
collide. The engine's counters and histograms are not restated here: they are made from their
declarations in tandem/core/stats.py (`EngineCounters`), named as the fields are. They arrive in
each instance's reports (`messages.Stats.counters`): a counter is advanced by the difference to
the instance's previous report, a histogram observes the values the report carries.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import time
from typing import Any

from tandem.core.stats import COUNTER, HISTOGRAM, EngineCounters, declared_metrics
from tandem.kvtransfer.protocol import MoveOutcome, MoveReport
from tandem.outputs import RequestOutput

# vLLM's buckets.
TRANSFER_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
MIGRATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# Stages a move copied while its request ran (0: a plain stop-and-copy); migration_max_stages bounds it.
STAGE_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16)
TTFT_BUCKETS: tuple[float, ...] = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
)
TTFT_BUCKETS += (20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS: tuple[float, ...] = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
)
ITL_BUCKETS += (20.0, 40.0, 80.0)
REQUEST_BUCKETS: tuple[float, ...] = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
)
REQUEST_BUCKETS += (120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = reg = CollectorRegistry()
        self.model_name = model_name
        m = ["model_name"]

        def gauge(name: str, doc: str) -> Any:
            return Gauge(f"tandem:{name}", doc, m, registry=reg).labels(model_name)

        def counter(name: str, doc: str) -> Any:
            return Counter(f"tandem:{name}", doc, m, registry=reg).labels(model_name)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(f"tandem:{name}", doc, m, buckets=buckets, registry=reg).labels(model_name)

        self.num_requests_running = gauge("num_requests_running", "Requests in the engine's running set.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting in the engine's queue.")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "KV cache usage (1 = full).")
        # The engine's counters and histograms (tandem/core/stats.py): field name -> metric (a
        # labelled one's parent, an unlabelled one's child).
        self.engine: dict[str, Any] = {}
        for name, spec in declared_metrics():
            labels = [*m, *spec.labels]
            metric: Any
            if spec.kind == HISTOGRAM:
                metric = Histogram(
                    spec.exposed_name(name), spec.help, labels, buckets=spec.buckets, registry=reg
                )
            else:
                metric = Counter(spec.exposed_name(name), spec.help, labels, registry=reg)
            self.engine[name] = metric if spec.labels else metric.labels(model_name)
        self.request_success = Counter(
            "tandem:request_success_total",
            "Finished requests by finish reason.",
            [*m, "finished_reason"],
            registry=reg,
        )
        tm = [*m, "tenant"]
        self.tenant_requests = Counter(
            "tandem:tenant_requests_total", "Requests per tenant by outcome.", [*tm, "outcome"], registry=reg
        )
        self.tenant_prompt_tokens = Counter(
            "tandem:tenant_prompt_tokens_total", "Prompt tokens per tenant.", tm, registry=reg
        )
        self.tenant_generation_tokens = Counter(
            "tandem:tenant_generation_tokens_total", "Generated tokens per tenant.", tm, registry=reg
        )
        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between output tokens.", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish.", REQUEST_BUCKETS)
        self.queue_time = hist("request_queue_time_seconds", "Arrival to first scheduled.", REQUEST_BUCKETS)
        self.prefill_time = hist(
            "request_prefill_time_seconds", "First scheduled to first token.", REQUEST_BUCKETS
        )
        self.decode_time = hist("request_decode_time_seconds", "First token to finish.", REQUEST_BUCKETS)
        im = [*m, "instance"]
        self.instance_running = Gauge(
            "tandem:instance_num_requests_running", "Requests running, per engine instance.", im, registry=reg
        )
        self.instance_waiting = Gauge(
            "tandem:instance_num_requests_waiting", "Requests waiting, per engine instance.", im, registry=reg
        )
        self.instance_kv_usage = Gauge(
            "tandem:instance_kv_cache_usage_perc", "KV cache usage, per engine instance.", im, registry=reg
        )
        self.migrations = Counter(
            "tandem:migrations_total",
            "Live migrations and prefill/decode hand-offs by outcome: completed, refused (the "
            "destination had no free sequence seat or no room for the blocks, so nothing was copied; "
            "the request stayed where it was, or fell back to recompute), aborted (the transfer failed "
            "after it began: the same fallbacks), recomputed (it had nothing computed, so it was "
            "resent instead), dropped (the destination gave up on a silent source).",
            [*m, "outcome"],
            registry=reg,
        )
        self.migration_downtime = hist(
            "migration_downtime_seconds",
            "What a completed live migration or prefill/decode hand-off cost its request, as its stream "
            "saw it: from its last output from the source instance to its first from the destination "
            "(the stages copied while it decoded are not in it; the pause, the last blocks' copy, the "
            "install and the destination's first step are).",
            MIGRATION_BUCKETS,
        )
        self.migration_stages = hist(
            "migration_stages",
            "Stages a completed move copied while its request kept decoding on the source, before the "
            "stop-and-copy (0: it was paused for the whole copy).",
            STAGE_BUCKETS,
        )
        self.kv_transfer_bytes = counter("kv_transfer_bytes_total", "KV cache bytes sent between instances.")
        self.kv_transfer_time = hist(
            "kv_transfer_seconds",
            "A completed KV transfer, from the move's start to the destination's confirmation (for a "
            "prefill/decode hand-off it overlaps the prefill; the first token streams from the prefill "
            "instance, so time to first token never includes it).",
            TRANSFER_BUCKETS,
        )
        # Per instance: the last report (its gauges) and the counters that report carried.
        self._latest: dict[int, Any] = {}
        self._last: dict[int, EngineCounters] = {}

    def observe_stats(self, stats: Any, instance: int = 0) -> None:
        """Apply an engine `messages.Stats` snapshot from one instance: the unlabelled gauges and
        counters are the sums over instances (KV usage: the mean), the `instance_*` gauges each's."""
        self._latest[instance] = stats
        self._set_totals()
        label = str(instance)
        self.instance_running.labels(self.model_name, label).set(stats.num_running)
        self.instance_waiting.labels(self.model_name, label).set(stats.num_waiting)
        self.instance_kv_usage.labels(self.model_name, label).set(stats.kv_usage)
        self._observe_counters(stats.counters, self._last.get(instance) or EngineCounters())
        self._last[instance] = stats.counters

    def _observe_counters(self, now: EngineCounters, last: EngineCounters) -> None:
        """Advance the engine metrics by one instance's report `now` (its previous: `last`). A
        counter that went down (a restarted engine) adds nothing until it passes its last value."""
        for name, spec in declared_metrics():
            metric, value = self.engine[name], getattr(now, name)
            if spec.kind == HISTOGRAM:
                for v, times in value.items():
                    for _ in range(times):
                        metric.observe(v)
            elif spec.kind == COUNTER and spec.labels:
                before = getattr(last, name)
                for key, count in value.items():
                    delta = count - before.get(key, 0)
                    if delta > 0:
                        metric.labels(self.model_name, key).inc(delta)
            else:
                delta = value - getattr(last, name)
                if delta > 0:
                    metric.inc(delta)

    def forget_instance(self, instance: int) -> None:
        """The instance is gone (retired or dead): its gauges leave the sums and the exposition,
        rather than keep its last report's values; what its counters added stays."""
        if self._latest.pop(instance, None) is None:
            return
        label = str(instance)
        for gauge in (self.instance_running, self.instance_waiting, self.instance_kv_usage):
            with contextlib.suppress(KeyError):
                gauge.remove(self.model_name, label)
        self._set_totals()

    def _set_totals(self) -> None:
        """The unlabelled gauges from the live instances' last reports."""
        latest = list(self._latest.values())
        self.num_requests_running.set(sum(s.num_running for s in latest))
        self.num_requests_waiting.set(sum(s.num_waiting for s in latest))
        self.kv_cache_usage.set(sum(s.kv_usage for s in latest) / len(latest) if latest else 0.0)

    def observe_finished(self, out: RequestOutput, tenant: str) -> None:
        """A request group that finished in the engine (any finish reason but a front-end abort)."""
        reason = out.outputs[0].finish_reason or "abort"
        self.request_success.labels(self.model_name, reason).inc()
        self.observe_tokens(tenant, len(out.prompt_token_ids), out.num_generation_tokens)
        self.tenant_requests.labels(self.model_name, tenant, "finished").inc()
        rm = out.metrics
        if rm is None:
            return
        end = rm.finished_time or time.monotonic()
        self.e2e.observe(max(0.0, end - rm.arrival_time))
        if rm.first_scheduled_time is not None:
            self.queue_time.observe(max(0.0, rm.first_scheduled_time - rm.arrival_time))
        if rm.first_token_time is not None:
            self.ttft.observe(max(0.0, rm.first_token_time - rm.arrival_time))
            self.decode_time.observe(max(0.0, end - rm.first_token_time))
            if rm.first_scheduled_time is not None:
                self.prefill_time.observe(max(0.0, rm.first_token_time - rm.first_scheduled_time))
        times = rm.token_times
        for a, b in itertools.pairwise(times):
            self.itl.observe(b - a)

    def observe_aborted(self, tenant: str, num_prompt_tokens: int, num_generated: int) -> None:
        self.request_success.labels(self.model_name, "abort").inc()
        self.tenant_requests.labels(self.model_name, tenant, "aborted").inc()
        self.observe_tokens(tenant, num_prompt_tokens, num_generated)

    def observe_failed(self, tenant: str) -> None:
        """A request that ended with an error (the engine's or the front end's, for it alone)."""
        self.request_success.labels(self.model_name, "error").inc()
        self.tenant_requests.labels(self.model_name, tenant, "failed").inc()

    def track_admission(self, inflight: Any, waiting: Any, connections: Any) -> None:
        """Gauges read at scrape time from the API process's own tables (callables returning ints)."""
        from prometheus_client import Gauge

        m = ["model_name"]
        for name, doc, fn in (
            (
                "api_requests_inflight",
                "Requests the API process has sent to the engine, not yet ended.",
                inflight,
            ),
            ("api_requests_waiting", "Of those, requests with no output yet (the admission bound).", waiting),
            ("http_connections", "Open HTTP connections.", connections),
        ):
            Gauge(f"tandem:{name}", doc, m, registry=self.registry).labels(self.model_name).set_function(fn)

    def track_cluster(
        self,
        num_instances: int,
        dispatched: Any,
        resumed: Any,
        migrating: Any,
        pd_fallbacks: Any,
        migrations_started: Any,
    ) -> None:
        """Gauges read at scrape time: requests dispatched to each instance (`dispatched(i)`),
        requests resumed on another instance after theirs died (`resumed()`), live migrations
        under way (`migrating()`), prefill/decode hand-offs that failed and fell back to computing
        the request on the decode side (`pd_fallbacks()`)."""
        from prometheus_client import Gauge

        m = ["model_name"]
        Gauge(
            "tandem:migrations_started",
            "Live migrations and prefill/decode hand-offs started (their outcomes: tandem:migrations_total).",
            m,
            registry=self.registry,
        ).labels(self.model_name).set_function(migrations_started)
        Gauge(
            "tandem:pd_fallbacks",
            "Prefill/decode hand-offs that failed; the decode instance computed the request itself.",
            m,
            registry=self.registry,
        ).labels(self.model_name).set_function(pd_fallbacks)
        Gauge(
            "tandem:migrations_running",
            "Live migrations under way (KV being copied between instances).",
            m,
            registry=self.registry,
        ).labels(self.model_name).set_function(migrating)
        g = Gauge(
            "tandem:instance_requests_dispatched",
            "Requests the dispatcher has sent to each instance (resumed ones included).",
            [*m, "instance"],
            registry=self.registry,
        )
        for i in range(num_instances):
            g.labels(self.model_name, str(i)).set_function(functools.partial(dispatched, i))
        Gauge(
            "tandem:requests_resumed",
            "Requests resumed on another instance after theirs died.",
            m,
            registry=self.registry,
        ).labels(self.model_name).set_function(resumed)

    def observe_migration(self, report: MoveReport) -> None:
        """A live migration's (or prefill/decode hand-off's) outcome, as the engine client reports it."""
        self.migrations.labels(self.model_name, report.outcome.value).inc()
        self.kv_transfer_bytes.inc(report.num_bytes)
        if report.outcome is MoveOutcome.COMPLETED:
            self.kv_transfer_time.observe(report.transfer_s)
            self.migration_stages.observe(report.num_stages)
            if report.downtime_s is not None:
                self.migration_downtime.observe(report.downtime_s)

    def observe_rejected(self, tenant: str) -> None:
        self.tenant_requests.labels(self.model_name, tenant, "rejected").inc()

    def observe_tokens(self, tenant: str, prompt: int, generated: int) -> None:
        self.tenant_prompt_tokens.labels(self.model_name, tenant).inc(prompt)
        self.tenant_generation_tokens.labels(self.model_name, tenant).inc(generated)

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
