"""The migration policy (tandem/cluster/rebalance.py) over hand-made instance views: drains empty an
instance toward the least loaded, priority moves make room for a waiting high-priority request,
imbalance moves the busiest's most recent request only when that narrows the gap, and no round
starts more moves than the concurrency bound allows. Randomized: a plan never moves a request to
its own instance, to a dead or draining one, or twice."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.cluster.config import ClusterConfig
from tandem.cluster.dispatch import InstanceView
from tandem.cluster.rebalance import Rebalancer, RequestView


def views(*demands: float, blocks: int = 100, seats: tuple[int, ...] = ()) -> list[InstanceView]:
    """Instances with these KV demands; `seats`: each one's free sequence seats (as its report
    says: of 4), none reported if empty."""
    out = [InstanceView(blocks, demand=d) for d in demands]
    for view, free in zip(out, seats):
        view.max_num_seqs, view.num_seats_taken = 4, 4 - free
    return out


def req(
    rid: str,
    instance: int,
    seq: int,
    demand: float = 10.0,
    priority: int = 0,
    started: bool = True,
    seats: int = 1,
):
    return RequestView(rid, instance, priority, started, seq, demand, seats)


def test_drain_moves_everything_to_the_least_loaded():
    reb = Rebalancer(ClusterConfig(num_instances=3, max_concurrent_migrations=8))
    reqs = [req("a", 1, 1), req("b", 1, 2, started=False), req("c", 0, 3)]
    plan = reb.plan(views(50, 40, 10), {0, 1, 2}, {1}, reqs, moving=0)
    assert plan == [("a", 2), ("b", 2)]
    assert reb.plan(views(50, 40, 10), {0, 1, 2}, {1}, reqs, moving=7) == [("a", 2)]  # one slot left


def test_priority_moves_a_lower_priority_request_off_a_crowded_instance():
    cfg = ClusterConfig(num_instances=2, migration_triggers=("priority",))
    reqs = [
        req("low", 0, 1, priority=5),
        req("mid", 0, 2, priority=1),
        req("vip", 0, 3, priority=-1, started=False),
    ]
    assert Rebalancer(cfg).plan(views(80, 20), {0, 1}, set(), reqs, 0) == [("low", 1)]
    # Nowhere less loaded to go: nothing moves.
    assert Rebalancer(cfg).plan(views(20, 80), {0, 1}, set(), reqs, 0) == []
    # No high-priority request waiting: nothing moves.
    assert Rebalancer(cfg).plan(views(80, 20), {0, 1}, set(), reqs[:2], 0) == []


def test_imbalance_moves_the_most_recent_request_when_it_narrows_the_gap():
    cfg = ClusterConfig(num_instances=2, migration_triggers=("imbalance",), imbalance_threshold=0.2)
    reqs = [req("old", 0, 1, demand=30), req("new", 0, 2, demand=20)]
    assert Rebalancer(cfg).plan(views(60, 10), {0, 1}, set(), reqs, 0) == [("new", 1)]
    # Within the threshold: nothing.
    assert Rebalancer(cfg).plan(views(40, 25), {0, 1}, set(), reqs, 0) == []
    # Moving it would overshoot (the gap would grow the other way): nothing.
    big = [req("old", 0, 1, demand=30), req("new", 0, 2, demand=60)]
    assert Rebalancer(cfg).plan(views(60, 30), {0, 1}, set(), big, 0) == []
    # A single request is never moved by imbalance (it would just move the imbalance).
    assert Rebalancer(cfg).plan(views(60, 10), {0, 1}, set(), reqs[:1], 0) == []


def test_a_destination_without_a_free_seat_is_never_chosen():
    """Before, the plan went by KV load alone: moves to instances whose every sequence seat was taken,
    which their receivers refused ("no free sequence slot": 80 of 86 live migrations in a probe)."""
    cfg = ClusterConfig(
        num_instances=3, migration_triggers=("imbalance", "priority"), max_concurrent_migrations=8
    )
    reqs = [req("old", 0, 1, demand=30), req("new", 0, 2, demand=20)]
    # Imbalance: the idlest instance is full; the next one has a seat, and moving there narrows that gap.
    assert Rebalancer(cfg).plan(views(60, 10, 20, seats=(0, 0, 1)), {0, 1, 2}, set(), reqs, 0) == [("new", 2)]
    # No seat anywhere: nothing moves, whatever the imbalance.
    assert Rebalancer(cfg).plan(views(60, 10, 20, seats=(0, 0, 0)), {0, 1, 2}, set(), reqs, 0) == []
    # Priority: the lower-priority request goes where a seat is, or stays.
    prio = [req("low", 0, 1, priority=5), req("vip", 0, 2, priority=-1, started=False)]
    assert Rebalancer(cfg).plan(views(80, 20, 30, seats=(0, 0, 2)), {0, 1, 2}, set(), prio, 0) == [("low", 2)]
    assert Rebalancer(cfg).plan(views(80, 20, 30, seats=(0, 0, 0)), {0, 1, 2}, set(), prio, 0) == []
    # A request of n samples needs n seats.
    wide = [req("old", 0, 1, demand=30), req("new", 0, 2, demand=20, seats=2)]
    assert Rebalancer(cfg).plan(views(60, 10, 20, seats=(0, 1, 2)), {0, 1, 2}, set(), wide, 0) == [("new", 2)]


def test_a_drain_fills_only_the_free_seats_and_waits_for_more():
    cfg = ClusterConfig(num_instances=3, max_concurrent_migrations=8)
    reqs = [req(f"r{j}", 0, j) for j in range(5)]
    # Instance 1 has one free seat, instance 2 two: three move this round (moves planned in the round
    # take seats too), least loaded first; the other two stay until seats free up.
    plan = Rebalancer(cfg).plan(views(50, 10, 20, seats=(0, 1, 2)), {0, 1, 2}, {0}, reqs, 0)
    assert plan == [("r0", 1), ("r1", 2), ("r2", 2)]
    assert Rebalancer(cfg).plan(views(50, 10, 20, seats=(0, 0, 0)), {0, 1, 2}, {0}, reqs, 0) == []
    # Seats taken by moves still under way count against their destination.
    plan = Rebalancer(cfg).plan(views(50, 10, 20, seats=(0, 1, 2)), {0, 1, 2}, {0}, reqs, 1, incoming={2: 2})
    assert plan == [("r0", 1)]


def test_free_seats_come_from_the_reports_and_what_was_routed_since():
    from tandem.cluster.dispatch import Dispatcher
    from tandem.engine.messages import EngineCoreRequest, Stats
    from tandem.sampling_params import SamplingParams

    d = Dispatcher(ClusterConfig(num_instances=2), [100, 100], 16)
    assert d.instances[0].free_seats == float("inf")  # nothing reported yet: no bound known
    report = Stats(1, 1, 0.1, num_blocks=100, num_seats_taken=2, max_num_seqs=8)
    d.observe(0, report)
    assert d.instances[0].free_seats == 8 - 2 - 1  # a waiting request takes a seat before any move
    d.routed(EngineCoreRequest("x", [1, 2], SamplingParams(n=3, max_tokens=4), 4, 0.0), 0)
    assert d.instances[0].free_seats == 8 - 2 - 1 - 3  # routed since the report: not in it yet
    d.observe(0, report)
    assert d.instances[0].free_seats == 5


@settings(max_examples=200, deadline=None)
@given(
    demands=st.lists(st.floats(0, 200), min_size=2, max_size=5),
    data=st.data(),
)
def test_plans_are_well_formed(demands, data):
    n = len(demands)
    free = [data.draw(st.integers(0, 4)) for _ in demands]
    live = set(data.draw(st.sets(st.integers(0, n - 1), min_size=1)))
    draining = set(data.draw(st.sets(st.sampled_from(sorted(live)))))
    moving = data.draw(st.integers(0, 4))
    reqs = [
        req(
            f"r{j}",
            data.draw(st.sampled_from(sorted(live))),
            j,
            data.draw(st.floats(1, 50)),
            data.draw(st.integers(-2, 2)),
            data.draw(st.booleans()),
            data.draw(st.integers(1, 3)),
        )
        for j in range(data.draw(st.integers(0, 12)))
    ]
    cfg = ClusterConfig(
        num_instances=n, migration_triggers=("imbalance", "priority"), max_concurrent_migrations=4
    )
    plan = Rebalancer(cfg).plan(views(*demands, seats=tuple(free)), live, draining, reqs, moving)
    where = {r.request_id: r.instance for r in reqs}
    seats = {r.request_id: r.seats for r in reqs}
    assert len(plan) <= max(0, 4 - moving)
    assert len({rid for rid, _ in plan}) == len(plan)
    for rid, dest in plan:
        assert dest in live and dest not in draining and dest != where[rid]
    # No destination is given more sequences than it has free seats.
    for i in range(n):
        assert sum(seats[rid] for rid, dest in plan if dest == i) <= free[i]
