"""Replay fidelity against a served run: the simulator driven by everything the run recorded except
its scheduling, set against the run request by request.

A served engine's step trace (tandem/engine/step_trace.py) keeps each step's start, duration and
shape, and for each request when the API process took it in, when its engine did, the step that
made its first token and the step that finished it. The replay gives the simulator the run's own
times for all that is not scheduling: the requests arrive when the API process took them in, reach
their engine after their recorded way in, each step lasts what the recorded one did and the loop
leaves the recorded gap before the next (`replay_steps(gaps=True)`, `RecordedTimes`). What the
simulator decides itself is what the run is checked for: which instance each request goes to
(the real placement and dispatcher), which requests share each step and how many tokens each gets
(the real scheduler), and so when each token comes out. A simulated step of another shape than
its recorded one is counted, as is a request placed on another instance than in the run.

Each request's TTFT (from the API process taking it in to the end of the step that made its first
token) and mean ITL (first to last token over the tokens between) are compared on the engine side,
where the simulator's decisions act; the client's legs (its request to the API process, the tokens'
way back) are the run's own and add the same to both sides. Engines are matched to instances by
the order of their first step; requests to the trace's by the order the API process placed them
(the load generator sends them in the trace's order). With the API process's own lines
(tandem/engine/front_trace.py), each request is placed when it was and leaves the dispatcher's
count when the front end saw it end, which is some time after its last step (the output's way to
the API process and its queue there): a request arriving between the two counts the ended one's
load, and the simulator, which releases at the step's end, would place it elsewhere.

With the run's move lines (`move_lines`), its moves are replayed as recorded
(tandem/sim/move_replay.py): which request moves where, and when, is taken from the run, since the
migration policy decides it on the server's timers over load reports that step durations do not
give; what the replay checks is that the simulator runs the same protocol, each stage and pause
after the same step with the same blocks (`ReplayReport.acts`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tandem.cluster.config import ClusterConfig
from tandem.core.step_shape import StepShape
from tandem.engine.step_trace import per_engine
from tandem.sim.cost import CostModel, FrontEndCpu
from tandem.sim.instance import InstanceSpec
from tandem.sim.move_replay import ActDone, move_fidelity
from tandem.sim.replay import MoveAct, RecordedMove, RecordedTimes, ReplayCost, engine_order, replay_steps
from tandem.sim.simulator import ClusterSim, SimResult
from tandem.sim.trace import Trace


@dataclass(slots=True)
class ServedRequest:
    """One request as a served engine's step trace recorded it (times: time.monotonic())."""

    request_id: str
    engine: int  # the process id of the engine that took it in
    arrival: float  # the API process took it in
    added: float  # its engine took it in
    placed: float | None = None  # the API process placed it (None: not recorded)
    released: float | None = None  # the API process released it from the dispatcher's count
    first_token: float | None = None  # the end of the step that made its first token
    finished: float | None = None  # the end of the step that made its last
    tokens: int = 0


def served_requests(
    lines: list[dict[str, Any]], front: dict[str, dict[str, float]] | None = None
) -> list[ServedRequest]:
    """Every request a step trace's engines took in, in the order the API process took them in;
    with its lines (`front`, `front_end_events`), each with when it was placed and released."""
    by_id: dict[str, ServedRequest] = {}
    for line in lines:
        for rid, added, arrival in line.get("added", ()):
            by_id[rid] = ServedRequest(rid, line["pid"], arrival, added)
    # A moved request's first token and finish may be on another engine than took it in.
    for line in lines:
        end = line["start"] + line["seconds"]
        for rid in line.get("first", ()):
            if rid in by_id:
                by_id[rid].first_token = end
        for rid, tokens in line.get("done", ()):
            if rid in by_id:
                by_id[rid].finished, by_id[rid].tokens = end, tokens
    if front is not None:
        for rid, r in by_id.items():
            r.placed = front["placed"].get(rid)
            r.released = front["released"].get(rid)
    return sorted(by_id.values(), key=lambda r: (r.arrival, r.added))


@dataclass(frozen=True)
class EngineSide:
    """The front end of a replay: no time of its own (the run's are given per request and per
    step), tokens counted as they leave their step; moves take `base`'s transfer times."""

    base: CostModel
    name: str = "the run's own times"

    def step_seconds(self, shape: StepShape, history: int | None = None) -> float:
        return self.base.step_seconds(shape, history)

    def transfer_seconds(self, num_blocks: int) -> float:
        return self.base.transfer_seconds(num_blocks)

    def delivery_seconds(self) -> float:
        return 0.0

    def ingress_seconds(self) -> float:
        return 0.0

    def loop_gap_seconds(self) -> float:
        return 0.0

    def co_run_slowdown(self, running: int) -> float:
        return 1.0

    def front_end_cpu(self) -> FrontEndCpu:
        return FrontEndCpu()


@dataclass(slots=True)
class RequestFidelity:
    """One request, the run against its replay (seconds, engine side)."""

    index: int
    request_id: str  # the run's id for it
    ttft: float
    ttft_replay: float
    itl: float | None  # mean ITL; None for a single token
    itl_replay: float | None
    placed_alike: bool


@dataclass
class ReplayReport:
    requests: list[RequestFidelity]
    steps: int  # recorded steps replayed
    diverged: int  # of those, simulated with another shape
    unrecorded: int  # simulated steps past the recorded ones
    first_divergence: list[tuple[int, StepShape, StepShape] | None]  # per instance
    result: SimResult
    missing: list[int] = field(default_factory=list)  # trace requests the run has no times for
    # Per request id of the run: when the replay's tokens came out, on the run's clock.
    token_times: dict[str, list[float]] = field(default_factory=dict)
    moves: list[RecordedMove] = field(default_factory=list)  # the run's, as replayed
    acts: list[ActDone] = field(default_factory=list)  # what the replay did at each recorded act

    def summary(self) -> dict[str, float]:
        """Per-request errors of the replay against the run (mean and P99 of |error|), the error of
        the mean TTFT and ITL over all requests, and the counts of what parted."""
        ttft = [abs(r.ttft_replay - r.ttft) / r.ttft for r in self.requests if r.ttft > 0]
        pairs = [(r.itl, r.itl_replay) for r in self.requests if r.itl and r.itl_replay is not None]
        itl = [abs(b - a) / a for a, b in pairs]

        def mean_error(real: Sequence[float], replay: Sequence[float]) -> float:
            return (sum(replay) - sum(real)) / sum(real) if sum(real) else float("nan")

        return {
            "requests": len(self.requests),
            "ttft_error_mean": _mean(ttft),
            "ttft_error_p99": _p99(ttft),
            "itl_error_mean": _mean(itl),
            "itl_error_p99": _p99(itl),
            "ttft_mean_error": mean_error(
                [r.ttft for r in self.requests], [r.ttft_replay for r in self.requests]
            ),
            "itl_mean_error": mean_error([a for a, _ in pairs], [b for _, b in pairs]),
            "ttft_max_abs_error_s": max(
                (abs(r.ttft_replay - r.ttft) for r in self.requests), default=float("nan")
            ),
            "itl_max_abs_error_s": max((abs(b - a) for a, b in pairs), default=float("nan")),
            "steps": self.steps,
            "steps_of_another_shape": self.diverged,
            "unrecorded_steps": self.unrecorded,
            "placed_elsewhere": sum(not r.placed_alike for r in self.requests),
            "requests_within_2pct": sum(
                abs(r.ttft_replay - r.ttft) <= 0.02 * r.ttft
                and (r.itl is None or r.itl_replay is None or abs(r.itl_replay - r.itl) <= 0.02 * r.itl)
                for r in self.requests
            ),
            "moves_run": sum(m.outcome == "completed" for m in self.moves),
            "moves_replay": self.result.migrations,
            **move_fidelity(self.acts, sum(len(m.acts) for m in self.moves)),
        }


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _p99(xs: Sequence[float]) -> float:
    if not xs:
        return float("nan")
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def replay_served_run(
    trace: Trace,
    lines: list[dict[str, Any]],
    spec: InstanceSpec,
    cluster: ClusterConfig,
    base: CostModel,
    vocab_size: int,
    front: dict[str, dict[str, float]] | None = None,
    moves: list[dict[str, Any]] | None = None,
) -> ReplayReport:
    """Replay a served run of `trace` from its step trace's `lines` (and the API process's, `front`;
    its moves' lines, `moves`, from `move_lines`) and compare each request."""
    served = served_requests(lines, front)
    if len(served) != len(trace.requests):
        raise ValueError(
            f"the step trace has {len(served)} requests and the trace {len(trace.requests)}: "
            "replay a run of exactly this trace (no warm-up requests)"
        )
    origin = served[0].arrival
    pids = engine_order(lines)[: cluster.num_instances]
    if len(pids) < cluster.num_instances:
        raise ValueError(f"the step trace has {len(pids)} engines for {cluster.num_instances} instances")
    steps = replay_steps(lines, pids, gaps=True)
    costs = [ReplayCost(EngineSide(base), s) for s in steps]
    firsts = {own[0]["pid"]: own[0]["start"] - origin for own in per_engine(lines) if own}
    placed = [r.arrival if r.placed is None else r.placed for r in served]
    # The simulator takes requests in as the front end placed them (which need not be the order it
    # took them in): order[i] is the trace request the replay's i-th is.
    order = sorted(range(len(served)), key=lambda k: (placed[k], k))
    instance_of = {pid: i for i, pid in enumerate(pids)}
    index_of = {served[k].request_id: i for i, k in enumerate(order)}
    recorded_moves = None if moves is None else recorded_move_list(moves, instance_of, index_of, origin)
    recorded = RecordedTimes(
        ingress_s=[served[k].added - placed[k] for k in order],
        first_step_s=[firsts[pid] for pid in pids],
        release_s=[None if (t := served[k].released) is None else t - origin for k in order],
        moves=recorded_moves,
    )
    arrivals = [replace(trace.requests[k], arrival_s=placed[k] - origin) for k in order]
    replayed = Trace(arrivals, trace.hash_block_tokens, trace.name)
    sim = ClusterSim(
        replayed,
        EngineSide(base),
        spec,
        cluster,
        vocab_size=vocab_size,
        max_waiting_requests=None,
        instance_costs=list(costs),
        recorded=recorded,
    )
    result = sim.run()
    requests, missing = [], []
    token_times: dict[str, list[float]] = {}
    for rec in result.records:
        k = order[rec.index]
        r = served[k]
        token_times[r.request_id] = [t + origin for t in rec.token_times]
        if r.first_token is None or r.finished is None or not rec.token_times:
            missing.append(k)
            continue
        times = rec.token_times
        itl = (r.finished - r.first_token) / (r.tokens - 1) if r.tokens > 1 else None
        itl_replay = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
        requests.append(
            RequestFidelity(
                k,
                r.request_id,
                r.first_token - r.arrival,
                times[0] + origin - r.arrival,
                itl,
                itl_replay,
                instance_of.get(r.engine) == rec.instance,
            )
        )
    first = [c.steps.first_divergence for c in costs]
    return ReplayReport(
        requests,
        steps=sum(c.steps.served for c in costs),
        diverged=sum(c.steps.diverged for c in costs),
        unrecorded=sum(c.steps.extra for c in costs),
        first_divergence=first,
        result=result,
        missing=missing,
        token_times=token_times,
        moves=recorded_moves or [],
        acts=[] if sim.move_replay is None else sim.move_replay.done,
    )


def recorded_move_list(
    lines: list[dict[str, Any]], instance_of: dict[int, int], index_of: dict[str, int], origin: float
) -> list[RecordedMove]:
    """The run's moves from its move lines: each the API process decided, with the acts its
    engines recorded from then until the next move of the same request was decided."""
    decided = sorted((line for line in lines if line["move"] == "decided"), key=lambda line: line["at"])
    moves: list[RecordedMove] = []
    for n, d in enumerate(decided):
        rid = d["request"]
        if rid not in index_of:
            continue
        until = min((e["at"] for e in decided[n + 1 :] if e["request"] == rid), default=float("inf"))
        mine = [line for line in lines if line["request"] == rid and d["at"] <= line["at"] < until]
        acts = tuple(
            MoveAct(
                instance_of[line["pid"]],
                line["move"],
                line["step"],
                line["at"] - origin,
                line.get("blocks"),
                line.get("outcome"),
            )
            for line in mine
            if line["pid"] in instance_of
        )
        landed = next((line for line in mine if line["move"] == "landed"), None)
        # The engines' own acts name the instances (the API process's indices need not be the order
        # of the engines' first steps, which is how the replay numbers them).
        source = next((a.instance for a in acts if a.kind == "begin"), d["source"])
        destination = next((a.instance for a in acts if a.kind in ("accept", "install")), d["destination"])
        moves.append(
            RecordedMove(
                index_of[rid],
                source,
                destination,
                d["at"] - origin,
                acts,
                None if landed is None else landed["at"] - origin,
                None if landed is None else landed["outcome"],
            )
        )
    return moves
