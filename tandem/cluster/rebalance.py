"""Which running requests move, and where: the migration policy of the global scheduler.

Like dispatch, it decides from reports and its own bookkeeping only (pure Python; the cluster
simulator runs it over simulated instances). Each round (`ClusterConfig.migration_interval_s`)
`plan` proposes moves, at most `max_concurrent_migrations` under way at once, and only to an
instance with a free sequence seat for each of the request's samples (`InstanceView.free_seats`,
less the seats of moves under way there and of moves planned this round): a destination without
one refuses the transfer, and proposing it only churns. With no such destination a request stays
where it is until a seat frees up (a drain waits for one):

- drain: every request on a draining instance goes to the least loaded other one (scale in);
- priority: on an instance where a high-priority request (priority < 0) waits, the lowest-priority
  running request there moves to the least loaded instance, if that one is less loaded;
- imbalance: while the busiest instance's load exceeds the idlest's by more than the threshold,
  the busiest's most recently dispatched running request moves (Llumnix's choice: it holds the
  least KV, so it is the cheapest to move, and has the most work left), if moving it narrows
  the gap.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.cluster.config import ClusterConfig
from tandem.cluster.dispatch import InstanceView


@dataclass(frozen=True, slots=True)
class RequestView:
    request_id: str
    instance: int
    priority: int
    started: bool  # has produced tokens: it runs (its KV is worth moving live)
    seq: int  # dispatch order; larger is more recent
    demand: float  # KV blocks it may come to hold, as the dispatcher counts it
    seats: int = 1  # sequence seats it takes where it runs (its samples, n)


class Rebalancer:
    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.num_planned = {"drain": 0, "priority": 0, "imbalance": 0}

    def plan(
        self,
        instances: list[InstanceView],
        live: set[int],
        draining: set[int],
        requests: list[RequestView],
        moving: int,
        incoming: dict[int, int] | None = None,
    ) -> list[tuple[str, int]]:
        """Moves (request id, destination) to start now; `moving`: moves under way, `incoming`:
        the seats they will take, per destination."""
        room = self.config.max_concurrent_migrations - moving
        targets = sorted(live - draining)
        if room <= 0 or not targets:
            return []
        load = {i: instances[i].load for i in live}
        seats = {i: instances[i].free_seats - (incoming or {}).get(i, 0) for i in live}
        moves: list[tuple[str, int]] = []

        planned: set[str] = set()

        def fits(r: RequestView, dest: int) -> bool:
            return seats[dest] >= r.seats

        def move(r: RequestView, dest: int, why: str) -> None:
            nonlocal room
            moves.append((r.request_id, dest))
            planned.add(r.request_id)
            room -= 1
            load[r.instance] -= r.demand / max(1, instances[r.instance].num_blocks)
            load[dest] += r.demand / max(1, instances[dest].num_blocks)
            # The source's seats come back only once the move is done (its report says so).
            seats[dest] -= r.seats
            self.num_planned[why] += 1

        by_instance: dict[int, list[RequestView]] = {}
        for r in requests:
            by_instance.setdefault(r.instance, []).append(r)

        for src in sorted(draining & live):
            for r in sorted(by_instance.get(src, []), key=lambda r: r.seq):
                if room <= 0:
                    return moves
                dests = [i for i in targets if fits(r, i)]
                if dests:
                    move(r, min(dests, key=lambda i: (load[i], i)), "drain")

        triggers = self.config.migration_triggers
        if "priority" in triggers:
            for src in targets:
                here = by_instance.get(src, [])
                waiting = [r.priority for r in here if not r.started and r.priority < 0]
                if not waiting or room <= 0:
                    continue
                victims = [r for r in here if r.started and r.priority > min(waiting) and r.request_id not in planned]
                if not victims:
                    continue
                victim = max(victims, key=lambda r: (r.priority, r.seq))
                others = [i for i in targets if i != src and load[i] < load[src] and fits(victim, i)]
                if others:
                    move(victim, min(others, key=lambda i: (load[i], i)), "priority")

        if "imbalance" in triggers and room > 0 and len(targets) > 1:
            src = max(targets, key=lambda i: (load[i], -i))
            movable = [r for r in by_instance.get(src, []) if r.started and r.request_id not in planned]
            if len(movable) > 1:
                newest = max(movable, key=lambda r: r.seq)
                # The least loaded instance with a seat for it (the idlest may have none).
                dests = [i for i in targets if i != src and fits(newest, i)]
                if dests:
                    dest = min(dests, key=lambda i: (load[i], i))
                    gap = load[src] - load[dest]
                    cost = newest.demand
                    shift = cost / max(1, instances[src].num_blocks) + cost / max(1, instances[dest].num_blocks)
                    # The gap narrows (it would not if the request outweighs it).
                    if gap > self.config.imbalance_threshold and shift < 2 * gap:
                        move(newest, dest, "imbalance")
        return moves
