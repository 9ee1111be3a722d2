"""Which instance a new request goes to: round_robin, least_load, prefix_aware.

The dispatcher never calls an instance on the request path. It decides from what it keeps itself
(the KV demand of the requests it has routed to each instance and not seen end) and from the
instances' periodic reports (`engine.messages.Stats`: available blocks, a summary of cached
prefixes). Pure Python: the cluster simulator can run the same code over simulated instances.

- `least_load` (Llumnix's virtual usage): an instance's load is the KV blocks its requests may
  come to hold (prompt plus max_tokens, times n; a high-priority request counts more) over its
  cache size; the least loaded instance gets the request, equally loaded ones in turn.
- `prefix_aware` (as SGLang's router): while the instances' in-flight request counts are in
  balance, the one holding the longest cached prefix of the prompt (from its report, plus prompts
  dispatched there since) gets it, ties and no prefix anywhere going to the least loaded; out of
  balance (see `ClusterConfig`), the one with the fewest requests in flight.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

from tandem.cluster.config import ClusterConfig
from tandem.core.engine_io import EngineCoreRequest
from tandem.core.prefix_cache import prefix_block_hashes
from tandem.engine.messages import Stats


@dataclass(slots=True)
class InstanceView:
    """What the dispatcher knows of one instance."""

    num_blocks: int
    demand: float = 0.0  # KV blocks its routed, unfinished requests may hold (weighted)
    inflight: int = 0  # routed, unfinished requests
    cached: set[int] = field(default_factory=set)  # prefix block hashes from its last summary
    recent: OrderedDict[int, None] = field(default_factory=OrderedDict)  # hashes dispatched since
    num_running: int = 0
    num_waiting: int = 0
    # Sequence seats from its last report (running and paused samples, and seats reserved for
    # incoming transfers) out of its max_num_seqs (0: not reported, no bound known), and the
    # sequences routed or moved there since that report (not in it yet).
    num_seats_taken: int = 0
    max_num_seqs: int = 0
    routed_since_report: int = 0

    @property
    def load(self) -> float:
        return self.demand / max(1, self.num_blocks)

    @property
    def free_seats(self) -> float:
        """Seats a request moved here could take now: none that its running, reserved, waiting
        (each takes a seat before anything moved in) or newly routed requests will take; inf when
        the instance has not reported its bound. A live migration to an instance without one is
        refused there, so the migration policy plans with this."""
        if self.max_num_seqs <= 0:
            return math.inf
        taken = self.num_seats_taken + self.num_waiting + self.routed_since_report
        return max(0, self.max_num_seqs - taken)


class Dispatcher:
    def __init__(self, config: ClusterConfig, num_blocks: list[int], block_size: int) -> None:
        self.config = config
        self.block_size = block_size
        self.instances = [InstanceView(n) for n in num_blocks]
        self._demand: dict[str, tuple[int, float]] = {}  # request id -> (instance, demand)
        self._next = 0
        self.num_dispatched = [0] * len(num_blocks)

    def choose(self, req: EngineCoreRequest, live: set[int]) -> int:
        """The instance for `req` among the live ones (ValueError if none is)."""
        candidates = sorted(live)
        if not candidates:
            raise ValueError("no engine instance is running")
        policy = self.config.dispatch_policy
        if policy == "round_robin":
            choice = candidates[self._next % len(candidates)]
            self._next += 1
        elif policy == "least_load":
            # Equal loads (idle instances, mostly) take turns from the last choice on: light traffic
            # spreads over the instances instead of all landing on the lowest index.
            n, start = len(self.instances), self._next
            choice = min(candidates, key=lambda i: (self.instances[i].load, (i - start) % n))
            self._next = choice + 1
        else:
            choice = self._prefix_aware(req, candidates)
        return choice

    def least_loaded(self, candidates: set[int]) -> int:
        """The least loaded of `candidates` (as least_load judges), without routing anything."""
        return min(sorted(candidates), key=lambda i: (self.instances[i].load, i))

    def _prefix_aware(self, req: EngineCoreRequest, candidates: list[int]) -> int:
        cfg = self.config
        counts = {i: self.instances[i].inflight for i in candidates}
        busiest, idlest = max(counts.values()), min(counts.values())
        if busiest - idlest > cfg.balance_abs_threshold and busiest > idlest * cfg.balance_rel_threshold:
            return min(candidates, key=lambda i: (counts[i], self.instances[i].load, i))
        hashes = prefix_block_hashes(req.prompt_token_ids, self.block_size, req.cache_salt)

        def matched(i: int) -> int:
            view = self.instances[i]
            n = 0
            for h in hashes:
                if h not in view.cached and h not in view.recent:
                    break
                n += 1
            return n

        return max(candidates, key=lambda i: (matched(i), -self.instances[i].load, -i))

    # -- bookkeeping ---------------------------------------------------------------------------

    def routed(self, req: EngineCoreRequest, instance: int) -> None:
        """`req` now runs on `instance` (new, or moved there)."""
        self.release(req.request_id)
        tokens = len(req.prompt_token_ids) + req.max_tokens
        demand: float = -(-tokens // self.block_size) * req.params.n
        if req.priority < 0:
            demand *= self.config.high_priority_weight
        view = self.instances[instance]
        view.demand += demand
        view.inflight += 1
        view.routed_since_report += req.params.n
        self._demand[req.request_id] = (instance, demand)
        self.num_dispatched[instance] += 1
        if self.config.dispatch_policy == "prefix_aware":
            for h in prefix_block_hashes(req.prompt_token_ids, self.block_size, req.cache_salt):
                view.recent[h] = None
                view.recent.move_to_end(h)
            while len(view.recent) > self.config.recent_prefix_blocks:
                view.recent.popitem(last=False)

    def demand_of(self, request_id: str) -> float:
        """The KV demand a routed request counts for (0 if unknown)."""
        entry = self._demand.get(request_id)
        return 0.0 if entry is None else entry[1]

    def release(self, request_id: str) -> None:
        """`request_id` ended (finished, aborted, failed) or left its instance."""
        entry = self._demand.pop(request_id, None)
        if entry is not None:
            instance, demand = entry
            view = self.instances[instance]
            view.demand = max(0.0, view.demand - demand)
            view.inflight -= 1

    def observe(self, instance: int, stats: Stats) -> None:
        """An instance's report."""
        view = self.instances[instance]
        view.num_running, view.num_waiting = stats.num_running, stats.num_waiting
        view.num_seats_taken, view.max_num_seqs = stats.num_seats_taken, stats.max_num_seqs
        view.routed_since_report = 0
        if stats.num_blocks:
            view.num_blocks = stats.num_blocks
        if stats.prefix_hashes is not None:
            view.cached = set(stats.prefix_hashes)
            view.recent.clear()

    def forget_instance(self, instance: int) -> None:
        """The instance died: what was routed there is released by the caller as it moves."""
        view = self.instances[instance]
        view.cached.clear()
        view.recent.clear()
