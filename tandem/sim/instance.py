"""One simulated engine instance: the real scheduler and KV cache manager, a step-time model
instead of the model forward.

Each step is planned by `Scheduler.schedule()` exactly as in the engine; its duration comes from
the cost model (`cost.step_seconds(shape_of(plan), history)`, the history being what this instance
ran just before: `tandem.sim.step_history`); when it ends, every request whose computed
tokens reach its known tokens "samples" a token (a fixed id: simulated requests ignore EOS and
run to their output length), and `Scheduler.update` does the rest (forks, stops, prefix cache).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.config import EngineConfig, field_default
from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.policy import SchedulingConfig
from tandem.core.request import Request, RequestStatus
from tandem.core.scheduler import Scheduler
from tandem.core.step_io import RunnerOutput, SchedulerOutput
from tandem.core.step_shape import StepShape, shape_of
from tandem.sim.cost import CostModel
from tandem.sim.step_history import StepHistory

# The token every simulated request samples (never an EOS: they stop at their output length).
SIM_TOKEN = 7


@dataclass(frozen=True, slots=True)
class InstanceSpec:
    """An instance's capacity and scheduling knobs, as `EngineConfig` names them; the knobs it shares
    with `EngineConfig` default to its defaults. A simulated instance has no checkpoint to size its
    KV cache and context from, so those two are its own."""

    num_blocks: int = 4096
    block_size: int = field_default(EngineConfig, "block_size")
    max_num_seqs: int = field_default(EngineConfig, "max_num_seqs")
    max_num_batched_tokens: int = field_default(EngineConfig, "max_num_batched_tokens")
    max_model_len: int = 8192
    enable_prefix_caching: bool = field_default(EngineConfig, "enable_prefix_caching")
    scheduling: SchedulingConfig = field(default_factory=SchedulingConfig)


class SimInstance:
    def __init__(
        self, index: int, spec: InstanceSpec, cost: CostModel, clock: list[float], record_steps: bool = False
    ) -> None:
        self.index = index
        self.spec = spec
        self.cost = cost
        self._clock = clock  # the simulator's current time, shared (one cell)
        self.kv = KVCacheManager(spec.num_blocks, spec.block_size, spec.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.kv,
            spec.max_num_seqs,
            spec.max_num_batched_tokens,
            spec.max_model_len,
            spec.scheduling,
            clock=lambda: self._clock[0],
        )
        self.plan: SchedulerOutput | None = None  # the step under way
        self.in_loop_gap = False  # between a step's end and the next plan (the cost model's loop gap)
        self.busy_s = 0.0  # seconds in working steps, as they lasted (longer on a shared host)
        self.num_steps = 0
        # (start, seconds, shape, waiting after planning) per working step, as the engine's
        # step trace records them (tandem/engine/step_trace.py); None unless asked for.
        self.steps: list[tuple[float, float, StepShape, int]] | None = [] if record_steps else None
        self._started: tuple[float, StepShape, int] | None = None  # the working step under way
        self.history = StepHistory()

    @property
    def has_work(self) -> bool:
        """Requests on it that are not finished (running, waiting or paused)."""
        return self.scheduler.has_unfinished()

    @property
    def busy(self) -> bool:
        return self.plan is not None or self.in_loop_gap

    def start_step(self) -> float | None:
        """Plan the next step; its duration alone on its host, or None if there is nothing to do."""
        if self.plan is not None or not self.scheduler.has_unfinished():
            return None
        plan = self.scheduler.schedule()
        if plan.is_empty:
            # Everyone waits (a stall the scheduler resolves next step): no time passes for work,
            # but the step still costs its fixed overhead so the loop moves on.
            self.plan = plan
            return self.cost.step_seconds(shape_of(plan))
        self.plan = plan
        shape = shape_of(plan)
        self._started = (self._clock[0], shape, self.scheduler.num_waiting)
        return self.cost.step_seconds(shape, self.history.before(self._clock[0]))

    def finish_step(self) -> list[Request]:
        """End the step under way; the requests that gained a token."""
        plan, self.plan = self.plan, None
        if plan is None or plan.is_empty:
            return []
        if self._started is not None:
            start, shape, waiting = self._started
            self._started = None
            self.busy_s += self._clock[0] - start
            self.history.after(shape, self._clock[0])
            if self.steps is not None:
                self.steps.append((start, self._clock[0] - start, shape, waiting))
        self.num_steps += 1
        out = RunnerOutput()
        for req, n in zip(plan.requests, plan.num_tokens):
            if req.num_computed_tokens + n >= req.num_tokens:
                out.sampled[req.request_id] = SIM_TOKEN
                for child in req.pending_children:
                    out.sampled[child.request_id] = SIM_TOKEN
        return self.scheduler.update(plan, out)

    def add(self, req: Request) -> None:
        self.scheduler.add_request(req)

    def remove(self, req: Request) -> None:
        """Take a request off this instance (moved elsewhere): its blocks are freed (cached)."""
        if not req.is_finished:
            self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_ABORTED)

    @property
    def kv_usage(self) -> float:
        return self.kv.usage
