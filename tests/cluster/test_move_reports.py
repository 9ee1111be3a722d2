"""What the front end reports of a move (`MoveReport`) and what the metrics make of it: the outcome as
an enum (no free text to branch on), the stages copied while the request ran, and the downtime as
the request's stream saw it: from its last output delivered from the source to its first from the
destination, held outputs included. Torch-free: the client over recording connections, no engine,
its clock the test's."""

from __future__ import annotations

import asyncio

import pytest

from tandem.core.engine_io import EngineCoreRequest, SampleOutput
from tandem.engine import messages as m
from tandem.engine.core_client import AsyncEngineClient, RequestStream
from tandem.engine.processor import OutputProcessor
from tandem.engine.tokenizer import Tokenizer
from tandem.entrypoints.openai.metrics import ServerMetrics
from tandem.kvtransfer.protocol import MoveOutcome, MoveReport
from tandem.sampling_params import SamplingParams


class Recording:
    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def send(self, payload: bytes) -> None:
        self.sent.append(payload)


class Client:
    """A client running request "r" on instance 0, at the time `now`."""

    def __init__(self, tokenizer_dir) -> None:
        self.now = 0.0
        self.reports: list[MoveReport] = []
        self.metrics = ServerMetrics("m")
        c = AsyncEngineClient(config=None, connections=[Recording(), Recording()])  # type: ignore[arg-type]
        c.clock = lambda: self.now
        c.migrations.on_migrated = self.observe
        c.instances.live = {0, 1}
        c.instances.kv_addresses = ["ipc://a", "ipc://b"]
        c.outputs = OutputProcessor(Tokenizer(str(tokenizer_dir)))
        req = EngineCoreRequest("r", [5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True), 8, 0.0)
        c.outputs.add(req, None)
        c.streams["r"] = RequestStream("r", asyncio.Event())
        c.router.send(req, 0)  # run 0 on instance 0
        self.c = c

    def observe(self, report: MoveReport) -> None:
        self.reports.append(report)
        self.metrics.observe_migration(report)

    def output(self, at: float, instance: int, token: int, run: int, finish: str | None = None) -> None:
        self.now = at
        so = SampleOutput("r", 0, [token], None, finish_reason=finish, incarnation=run)
        self.c._handle(instance, m.Outputs([so]))

    def migrated(self, at: float, outcome: MoveOutcome = MoveOutcome.COMPLETED, stages: int = 2) -> None:
        self.now = at
        msg = m.Migrated("r", "r@1", outcome, num_bytes=4096, num_stages=stages, transfer_s=0.5, pause_s=0.01)
        self.c._handle(0, msg)

    def sample(self, name: str) -> float:
        for metric in self.metrics.registry.collect():
            for s in metric.samples:
                if s.name == name:
                    return s.value
        return 0.0


@pytest.fixture
def client(tokenizer_dir) -> Client:
    return Client(tokenizer_dir)


def test_downtime_runs_from_the_last_source_output_to_the_first_destination_output(client):
    client.output(1.0, 0, 11, run=0)
    client.c.migrations.start("r", 0, 1)
    client.output(1.5, 0, 12, run=0)  # it decodes on the source while its KV is copied
    client.output(1.6, 1, 13, run=1)  # the destination's first output, held: not the stream's yet
    client.migrated(1.62)  # the route switches: the held output reaches the stream now
    (report,) = client.reports
    assert report.outcome is MoveOutcome.COMPLETED and report.num_stages == 2
    assert report.downtime_s == pytest.approx(0.12)
    assert client.sample("tandem:migration_downtime_seconds_count") == 1
    assert client.sample("tandem:migration_downtime_seconds_sum") == pytest.approx(0.12)
    assert client.sample("tandem:migration_stages_sum") == 2
    assert client.sample("tandem:migrations_total") == 1


def test_a_completed_move_is_reported_at_the_destinations_first_output(client):
    client.output(1.0, 0, 11, run=0)
    client.c.migrations.start("r", 0, 1)
    client.migrated(1.1)  # nothing held yet
    assert client.reports == [] and client.sample("tandem:migrations_total") == 0
    client.output(1.3, 1, 12, run=1)
    (report,) = client.reports
    assert report.downtime_s == pytest.approx(0.3)


def test_a_request_that_ends_before_the_destination_speaks_has_no_downtime(client):
    client.c.migrations.start("r", 0, 1)
    client.migrated(1.1)
    client.c.abort(["r"])
    (report,) = client.reports
    assert report.outcome is MoveOutcome.COMPLETED and report.downtime_s is None
    assert client.sample("tandem:migration_downtime_seconds_count") == 0
    assert client.sample("tandem:migration_stages_count") == 1


@pytest.mark.parametrize("outcome", [MoveOutcome.REFUSED, MoveOutcome.ABORTED])
def test_a_move_that_failed_is_reported_at_once_and_the_request_stays(client, outcome):
    client.c.migrations.start("r", 0, 1)
    client.migrated(1.0, outcome, stages=0)
    (report,) = client.reports
    assert report.outcome is outcome and report.downtime_s is None
    assert client.c.routes["r"] == 0
    assert (
        client.sample("tandem:migrations_total") == 1 and client.sample("tandem:migration_stages_count") == 0
    )


def test_a_dropped_transfer_is_reported_as_dropped(client):
    client.c.migrations.start("r", 0, 1)
    client.c._handle(1, m.TransferDropped("r", "r@1", "no word from the source"))
    (report,) = client.reports
    assert report.outcome is MoveOutcome.DROPPED
    labels = {
        s.labels["outcome"]: s.value
        for metric in client.metrics.registry.collect()
        if metric.name == "tandem:migrations"
        for s in metric.samples
        if s.name.endswith("_total")
    }
    assert labels == {"dropped": 1}
