"""A destination that refuses a live migration up front (no free sequence seat, no room for the
blocks) makes the source report a refusal (`MoveOutcome.REFUSED`), which the front end counts apart
from transfers that failed after they began (tests/cluster/test_migration_refusals.py)."""

from __future__ import annotations

import pytest
from cluster_harness import Cluster

from tandem import SamplingParams
from tandem.config import EngineConfig
from tandem.core.engine_io import EngineCoreRequest
from tandem.kvtransfer.protocol import Migrated, MoveOutcome

GREEDY = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)


@pytest.mark.parametrize("short", ["seats", "blocks"])
def test_a_destination_without_room_reports_a_refusal(llama_dir, tmp_path, short):
    cfg = EngineConfig(model=str(llama_dir), num_kv_blocks=96, num_threads=1, block_size=4, max_num_seqs=8)
    cluster = Cluster(cfg, tmp_path)
    try:
        cluster.add(EngineCoreRequest("r0", list(range(5, 42)), GREEDY, GREEDY.max_tokens, 0.0), 0)
        for _ in range(4):
            cluster.tick()
        a, b = cluster.nodes
        if short == "seats":
            b.core.scheduler.reserved_seats = b.core.scheduler.max_num_seqs
        else:
            hog = b.core.kv.pool.allocate(b.core.kv.pool.num_free)
        assert cluster.migrate("r0", 1)
        cluster.deliver()  # the Begin, refused there, and the answer
        (report,) = cluster.reports
        assert isinstance(report, Migrated) and report.outcome is MoveOutcome.REFUSED, report
        assert report.num_bytes == 0  # nothing was copied
        assert ("no free sequence slot" in report.reason) == (short == "seats")
        assert cluster.requests["r0"].node == 0 and not a.core.scheduler.paused
        if short == "seats":
            b.core.scheduler.reserved_seats = 0
        else:
            b.core.kv.pool.free(hog)
        cluster.settle()
        for node in cluster.nodes:
            node.check_idle()
    finally:
        cluster.close()
