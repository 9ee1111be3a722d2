"""The load part of an instance's report (`messages.Stats`): what the dispatcher and the migration
policy read of an instance, built in one place for the engine loop (tandem/engine/core_proc.py)
and the cluster simulator's instances (tandem/sim/simulator.py).

A report carries the running and waiting counts, KV usage, blocks in all and obtainable now,
sequence seats taken and their bound, and, when the prefix cache changed since the last report
that carried it and at most every `PREFIX_REPORT_INTERVAL_S`, the hashes of its cached blocks
(shallowest first, at most `MAX_REPORTED_PREFIX_HASHES`).
"""

from __future__ import annotations

from typing import Any

from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.scheduler import Scheduler

# A busy engine reports at most this often (and on each finish, and after an abort).
STATS_INTERVAL_S = 0.2
# The prefix-cache summary in a report: at most this often, at most this many block hashes.
PREFIX_REPORT_INTERVAL_S = 1.0
MAX_REPORTED_PREFIX_HASHES = 16384


class LoadReport:
    """One instance's load reports; `with_prefixes=False` leaves the prefix summary out (a
    simulated cluster whose dispatcher does not read it)."""

    def __init__(self, with_prefixes: bool = True) -> None:
        self.with_prefixes = with_prefixes
        self._prefix_version = -1
        self._last_prefix_report = float("-inf")
        # The prefix cache changed but the summary was held back (too soon): a later report carries it.
        self.prefix_pending = False

    def fields(self, scheduler: Scheduler, kv: KVCacheManager, now: float) -> dict[str, Any]:
        """The load fields of a `Stats` report made at `now` (seconds, the caller's clock)."""
        return {
            "num_running": scheduler.num_in_flight,
            "num_waiting": scheduler.num_waiting,
            "kv_usage": kv.usage,
            "num_blocks": kv.num_blocks,
            "num_available_blocks": kv.num_available,
            "prefix_hashes": self._prefix_summary(kv, now),
            "num_seats_taken": scheduler.seats_taken,
            "max_num_seqs": scheduler.max_num_seqs,
        }

    def _prefix_summary(self, kv: KVCacheManager, now: float) -> list[int] | None:
        cache = kv.cache
        self.prefix_pending = False
        if not self.with_prefixes or cache is None or cache.version == self._prefix_version:
            return None
        if now - self._last_prefix_report < PREFIX_REPORT_INTERVAL_S:
            self.prefix_pending = True
            return None
        self._prefix_version = cache.version
        self._last_prefix_report = now
        return cache.block_hashes(MAX_REPORTED_PREFIX_HASHES)
