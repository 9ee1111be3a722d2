"""A live migration its destination refused (no free sequence seat, no room for its blocks) is a
refusal, not an abort: the front end counts it apart (`tandem:migrations_total{outcome="refused"}`,
`AsyncEngineClient.num_live_refused`) and says so in its log. Before, 80 of 86 migrations in a probe
were refusals, all counted as "aborted", with nothing in the server log. Torch-free: the front end's
client over recording connections, no engine."""

from __future__ import annotations

import logging

import pytest

from tandem.core.engine_io import EngineCoreRequest
from tandem.engine import messages as m
from tandem.engine.core_client import AsyncEngineClient
from tandem.entrypoints.openai.metrics import ServerMetrics
from tandem.kvtransfer.protocol import MoveOutcome
from tandem.sampling_params import SamplingParams


class Recording:
    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def send(self, payload: bytes) -> None:
        self.sent.append(payload)


def client_moving(rid: str) -> AsyncEngineClient:
    """A client with `rid` running on instance 0 and a live move of it to instance 1 under way."""
    c = AsyncEngineClient(config=None, connections=[Recording(), Recording()])  # type: ignore[arg-type]
    c.instances.live = {0, 1}
    c.instances.kv_addresses = ["ipc://a", "ipc://b"]
    c.router.send(EngineCoreRequest(rid, [1, 2, 3], SamplingParams(max_tokens=8), 8, 0.0), 0)
    c.migrations.start(rid, 0, 1)
    assert c.moves[rid].transfer_id == f"{rid}@1"
    return c


def outcomes(metrics: ServerMetrics) -> dict[str, float]:
    out = {}
    for metric in metrics.registry.collect():
        if metric.name == "tandem:migrations":
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    out[sample.labels["outcome"]] = sample.value
    return out


def test_a_refusal_is_counted_and_logged_as_a_refusal(caplog: pytest.LogCaptureFixture) -> None:
    metrics = ServerMetrics("m")
    c = client_moving("r")
    c.migrations.on_migrated = metrics.observe_migration
    refusal = m.Migrated("r", "r@1", MoveOutcome.REFUSED, "no free sequence slot")
    with caplog.at_level(logging.INFO, logger="tandem.client"):
        c.migrations.outcome(0, refusal)
    assert c.num_live_refused == 1 and c.num_live_aborted == 0
    assert c.routes["r"] == 0 and "r" not in c.moves  # it goes on where it was
    assert outcomes(metrics).get("refused") == 1 and outcomes(metrics).get("aborted", 0) == 0
    assert any(
        "refused" in r.getMessage() and "no free sequence slot" in r.getMessage() for r in caplog.records
    )


def test_a_transfer_that_failed_is_still_an_abort() -> None:
    metrics = ServerMetrics("m")
    c = client_moving("r")
    c.migrations.on_migrated = metrics.observe_migration
    c.migrations.outcome(0, m.Migrated("r", "r@1", MoveOutcome.ABORTED, "the destination stopped answering"))
    assert c.num_live_aborted == 1 and c.num_live_refused == 0
    assert outcomes(metrics).get("aborted") == 1 and outcomes(metrics).get("refused", 0) == 0


def test_the_outcome_crosses_the_wire() -> None:
    enc, dec = m.encoder(), m.client_decoder()
    msg = m.Migrated("r", "r@1", MoveOutcome.REFUSED, "no free sequence slot")
    assert dec.decode(enc.encode(msg)) == msg
    stats = m.Stats(1, 0, 0.1, num_seats_taken=3, max_num_seqs=8)
    assert dec.decode(enc.encode(m.Outputs([], stats))).stats == stats
