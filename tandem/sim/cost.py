"""Step-time models: how long one engine step takes, given what the scheduler planned for it.

The simulator runs Tandem's real scheduler and asks a `CostModel` for the duration of each step in
place of running the model. Two kinds:

- `FittedCost`: a linear model over features of the step (tokens, rows, context, attention work),
  fitted by non-negative least squares on steps timed on a real engine (`tandem.sim.profile`), with
  factors per (prompt tokens, decode rows) cell and per step history (what ran just before) where
  served steps show the linear model's bias (`tandem.sim.calibrate`). It is only as good as the
  machine and model it was measured on, and says how good in `fit_error`.
- `RooflineCost`: derived from a model's shape and a GPU's spec numbers (peak FLOP/s, memory
  bandwidth), for hardware we cannot measure: a step costs a fixed overhead plus the larger of its
  compute time and its memory-traffic time.

Both say what moving KV blocks between instances costs (`transfer_seconds`). Both are stored as
JSON (`save_cost`, `load_cost`) with a "kind" of "fitted" or "roofline".

`shape_of` (tandem/core/step_shape.py) turns a `SchedulerOutput` into a `StepShape`; the simulator,
the profiler and the engine's step trace all use it, so a fitted model is queried with exactly the
features it was fitted on. This module needs no torch.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable

import numpy as np

from tandem.core.step_shape import StepShape
from tandem.sim.step_history import kind as step_kind

FITTED = "fitted"
ROOFLINE = "roofline"


@dataclass(frozen=True, slots=True)
class FrontEndCpu:
    """The front end's two stages, the API process and the client reading the stream: seconds of
    CPU per engine output message and per token it carries."""

    api_message_s: float = 0.0
    api_token_s: float = 0.0
    client_message_s: float = 0.0
    client_token_s: float = 0.0

    @property
    def measured(self) -> bool:
        return any(getattr(self, name) for name in FRONT_END_FIELDS)


@runtime_checkable
class CostModel(Protocol):
    """Seconds of engine work, for the simulator's clock."""

    @property
    def name(self) -> str: ...

    def step_seconds(self, shape: StepShape, history: int | None = None) -> float:
        """Seconds of a step of `shape`; `history` (`tandem.sim.step_history`) says what the engine
        ran just before, for models that tell those apart (None: not known)."""
        ...

    def transfer_seconds(self, num_blocks: int) -> float:
        """Moving `num_blocks` KV blocks between instances (send, receive and copy into the cache)."""
        ...

    def delivery_seconds(self) -> float:
        """From the end of the step that made a token to the client reading it: the engine's output
        message, the API process's detokenizing and SSE chunk, the HTTP hop (and the request's own
        way in, before the API process takes it), as the client sees it. 0 when not measured."""
        ...

    def ingress_seconds(self) -> float:
        """From a request's arrival at the API process to the engine having it (parsing, the
        processor, the message to the engine process). 0 when not measured."""
        ...

    def loop_gap_seconds(self) -> float:
        """The engine loop's own time between two busy steps (sending outputs, taking in new
        requests, statistics), which the step times leave out. 0 when not measured."""
        ...

    def co_run_slowdown(self, running: int) -> float:
        """How much longer a step takes while `running` instances (itself included) run steps on
        one host, sharing its cores, caches and memory bandwidth (CPU instances). 1.0 alone."""
        ...

    def front_end_cpu(self) -> FrontEndCpu:
        """CPU seconds the API process and the client spend per engine output message and per
        token in it; the simulator queues the messages for them (`tandem.sim.frontend`). Zeros when
        not measured: then every token takes `delivery_seconds` alone."""
        ...


# -- the fitted model -----------------------------------------------------------------------------

# The AMX tile kernel's largest row count (tandem/model/linear.py `_AMX_MAX_ROWS`; a test keeps the
# two equal): the simulator does not import the model's torch-side modules.
TILE_KERNEL_MAX_ROWS = 64

# The features a fitted model may use, each a number of a StepShape; `select_features` picks a subset
# from the measurements. Each stands for a cost that scales differently:
FEATURES: Mapping[str, Callable[[StepShape], float]] = MappingProxyType(
    {
        # per step: scheduling, batch building, launching every layer's operators
        "const": lambda s: 1.0,
        # per step of more than one token: the matmuls leave the matrix-vector path (a one-row step is
        # markedly cheaper than the per-token cost predicts, on CPUs at least)
        "multi_row": lambda s: 1.0 if s.tokens > 1 else 0.0,
        # per step of more rows than the AMX tile kernel takes: bfloat16 linears go to oneDNN, which
        # pays a fixed cost a step that one per-token cost cannot follow (docs/simulator.md, (b));
        # where no step crosses it or it costs nothing, forward selection leaves it out
        "big_step": lambda s: 1.0 if s.tokens > TILE_KERNEL_MAX_ROWS else 0.0,
        # per query token: the weight matmuls (drafts are tokens too)
        "tokens": lambda s: float(s.tokens),
        # per row that computes logits and samples (a decode and each verified draft), beyond its token
        "logit_rows": lambda s: float(s.decode_rows + s.draft_tokens),
        # per prompt chunk: the attention path for long queries (gathers, masks, an SDPA call per
        # layer) that a step of decodes alone does not take
        "prompt_chunks": lambda s: float(s.num_requests - s.decode_rows),
        # per request in the batch: its Python bookkeeping in scheduler, runner and update
        "requests": lambda s: float(s.num_requests),
        # per context token: reading a request's K and V
        "context_tokens": lambda s: float(s.context_tokens),
        # per (query, key) pair beyond each key read once: a prompt chunk's attention, quadratic in
        # its length (decode rows have none, so this separates from `context_tokens`)
        "extra_attention": lambda s: float(s.attention_pairs - s.context_tokens),
    }
)


def feature_matrix(shapes: Sequence[StepShape], names: Sequence[str]) -> np.ndarray:
    """Rows of feature values, one per shape, in the order of `names`."""
    return np.array([[FEATURES[n](s) for n in names] for s in shapes], dtype=np.float64).reshape(
        len(shapes), len(names)
    )


def size_bin(n: int) -> int:
    """Half-octave bin of a count: 0 and 1 on their own, then two bins per power of two (2, 3, 4-5,
    6-7, 8-11, 12-15, 16-23, ...)."""
    if n <= 1:
        return max(n, 0)
    top = n.bit_length()
    return 2 * top - 2 + ((n >> (top - 2)) & 1)


def shape_cell(shape: StepShape) -> tuple[int, int]:
    """The (prompt tokens, decode rows) cell of a step shape, each a `size_bin`: where a fitted
    model's shape corrections apply."""
    return size_bin(shape.prefill_tokens), size_bin(shape.decode_rows)


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin ||a x - b|| subject to x >= 0, for a few columns.

    The optimum is the unconstrained least-squares solution on its own support, so it is the best
    non-negative one among the least-squares solutions of every subset of columns: exact, and with
    the handful of features here (2^8 subsets) cheaper than an iterative solver and no scipy."""
    cols = a.shape[1]
    best, best_err = np.zeros(cols), float(np.sum(b * b))
    for k in range(1, cols + 1):
        for subset in itertools.combinations(range(cols), k):
            idx = list(subset)
            x_sub, *_ = np.linalg.lstsq(a[:, idx], b, rcond=None)
            if np.any(x_sub < 0):
                continue
            x = np.zeros(cols)
            x[idx] = x_sub
            r = a @ x - b
            err = float(r @ r)
            if err < best_err:
                best, best_err = x, err
    return best


def fit_coefficients(
    shapes: Sequence[StepShape], seconds: Sequence[float], names: Sequence[str]
) -> np.ndarray:
    """Non-negative coefficients of `names` that minimise the squared *relative* error.

    Relative, because step times span three orders of magnitude (a one-row decode to a 2k-token
    prefill): plain least squares would fit the long steps and leave the short ones, which are most
    of a serving trace's steps, tens of percent off."""
    t = np.asarray(seconds, dtype=np.float64)
    x = feature_matrix(shapes, names)
    return nnls(x / t[:, None], np.ones_like(t))


def percent_errors(predicted: Sequence[float], measured: Sequence[float]) -> np.ndarray:
    p, m = np.asarray(predicted, dtype=np.float64), np.asarray(measured, dtype=np.float64)
    return 100.0 * np.abs(p - m) / m


# Folds of the cross-validation that picks features (on the training shapes only).
CV_FOLDS = 5
# A feature joins only if it cuts the cross-validated mean absolute % error by at least this many
# points: fewer features extrapolate better to shapes the grid did not cover.
MIN_GAIN_POINTS = 0.5


def cv_error(shapes: Sequence[StepShape], seconds: Sequence[float], names: Sequence[str]) -> float:
    """Mean absolute % error of `names` over CV_FOLDS interleaved folds (each fitted on the rest)."""
    n = len(shapes)
    folds = min(CV_FOLDS, n)
    errors: list[float] = []
    for f in range(folds):
        test = [i for i in range(n) if i % folds == f]
        train = [i for i in range(n) if i % folds != f]
        coef = fit_coefficients([shapes[i] for i in train], [seconds[i] for i in train], names)
        pred = feature_matrix([shapes[i] for i in test], names) @ coef
        errors.extend(percent_errors(pred, [seconds[i] for i in test]))
    return float(np.mean(errors))


def select_features(
    shapes: Sequence[StepShape], seconds: Sequence[float], candidates: Sequence[str] = tuple(FEATURES)
) -> list[str]:
    """Forward selection: start from the per-step constant, add the candidate that most lowers the
    cross-validated error, stop when none lowers it by MIN_GAIN_POINTS. A feature the grid cannot
    tell apart from the chosen ones (always zero, or proportional to one) never earns its place."""
    chosen = ["const"]
    current = cv_error(shapes, seconds, chosen)
    rest = [c for c in candidates if c != "const"]
    while rest:
        scored = [(cv_error(shapes, seconds, [*chosen, c]), c) for c in rest]
        err, best = min(scored)
        if current - err < MIN_GAIN_POINTS:
            break
        chosen.append(best)
        rest.remove(best)
        current = err
    return chosen


@dataclass(frozen=True, slots=True)
class FitError:
    """How far a fitted model is from held-out measurements, in percent of the measured time."""

    mape: float  # mean absolute % error
    p90: float  # 90th percentile of the absolute % error
    max: float
    num_train: int
    num_test: int

    @staticmethod
    def of(predicted: Sequence[float], measured: Sequence[float], num_train: int) -> FitError:
        e = percent_errors(predicted, measured)
        return FitError(
            mape=float(np.mean(e)),
            p90=float(np.percentile(e, 90)),
            max=float(np.max(e)),
            num_train=num_train,
            num_test=len(e),
        )


class ServingTimes:
    """The `CostModel` answers both kinds of model give from their serving fields (SERVING_FIELDS)."""

    __slots__ = ()
    delivery_s: float
    ingress_s: float
    loop_gap_s: float
    co_run_penalty: float
    api_message_s: float
    api_token_s: float
    client_message_s: float
    client_token_s: float

    def delivery_seconds(self) -> float:
        return self.delivery_s

    def ingress_seconds(self) -> float:
        return self.ingress_s

    def loop_gap_seconds(self) -> float:
        return self.loop_gap_s

    def co_run_slowdown(self, running: int) -> float:
        return 1.0 + self.co_run_penalty * max(0, running - 1)

    def front_end_cpu(self) -> FrontEndCpu:
        return FrontEndCpu(**{name: getattr(self, name) for name in FRONT_END_FIELDS})


@dataclass(frozen=True, slots=True)
class FittedCost(ServingTimes):
    """t = sum of coefficient * feature (FEATURES), fitted on timed steps of one model on one machine;
    transfers t = transfer_t0_s + transfer_per_block_s * blocks, fitted on timed KV transfers."""

    name: str
    coefficients: Mapping[str, float]  # feature name -> seconds per unit of it
    transfer_t0_s: float = 0.0
    transfer_per_block_s: float = 0.0
    fit_error: FitError | None = None  # of step times on held-out shapes
    transfer_fit_error: FitError | None = None
    # The front end and the engine loop (`delivery_seconds`, `ingress_seconds`, `loop_gap_seconds`),
    # timed through a real server at light load (`tandem.sim.profile.time_front_end`) or, for the
    # loop gap, on a served step trace (`tandem.sim.calibrate`). Serving figures, not the steps'.
    delivery_s: float = 0.0
    ingress_s: float = 0.0
    loop_gap_s: float = 0.0
    # Each other instance running a step on the same host makes a step this much longer (fitted on
    # a served trace of several engines on one machine, `tandem.sim.calibrate.calibrate_co_run`).
    co_run_penalty: float = 0.0
    # The front end's CPU per engine output message and per token in it, for the API process and
    # for the client (from their CPU time at two loads: `time_front_end`).
    api_message_s: float = 0.0
    api_token_s: float = 0.0
    client_message_s: float = 0.0
    client_token_s: float = 0.0
    # Factors on the linear model's seconds per shape cell (`shape_cell`): a step's real cost is not
    # linear in its size (on the Sapphire Rapids VM a prompt chunk's tokens get cheaper as the chunk
    # grows and a decode row dearer as the batch grows), and a fit to served steps, most of them
    # small, misses both ends by 10-15%: the full prompt chunks of a burst and the full decode
    # batches of an overloaded engine. Measured per cell on served steps (`tandem.sim.calibrate`);
    # a cell without one keeps the linear seconds.
    corrections: Mapping[tuple[int, int], float] = field(default_factory=dict)
    # Factors per (step kind, history) class (`tandem.sim.step_history`): what the step before left
    # in the caches. Measured on served steps with the cell corrections; applied on top of them.
    transitions: Mapping[tuple[int, int], float] = field(default_factory=dict)
    # Free-form provenance: what was measured where and when (model, threads, dtype, machine, note,
    # the measurements themselves); kept through save and load, never read by the model.
    meta: Mapping[str, Any] = field(default_factory=dict)
    # (coefficient, feature) pairs, resolved once: the simulator asks for every step it runs.
    _terms: tuple[tuple[float, Callable[[StepShape], float]], ...] = field(
        init=False, repr=False, compare=False, default=()
    )

    def __post_init__(self) -> None:
        unknown = set(self.coefficients) - set(FEATURES)
        if unknown:
            raise ValueError(f"unknown cost features {sorted(unknown)}; known: {sorted(FEATURES)}")
        object.__setattr__(self, "_terms", tuple((c, FEATURES[n]) for n, c in self.coefficients.items()))

    def step_seconds(self, shape: StepShape, history: int | None = None) -> float:
        if shape.num_requests == 0:
            return 0.0
        total = 0.0
        for c, feature in self._terms:
            total += c * feature(shape)
        if self.corrections:
            total *= self.corrections.get(shape_cell(shape), 1.0)
        if history is not None and self.transitions:
            total *= self.transitions.get((step_kind(shape), history), 1.0)
        return total

    def transfer_seconds(self, num_blocks: int) -> float:
        return self.transfer_t0_s + self.transfer_per_block_s * num_blocks if num_blocks > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": FITTED,
            "name": self.name,
            "coefficients": dict(self.coefficients),
            "transfer": {"t0_s": self.transfer_t0_s, "per_block_s": self.transfer_per_block_s},
            **serving_dict(self),
            "fit_error": None if self.fit_error is None else asdict(self.fit_error),
            "transfer_fit_error": None
            if self.transfer_fit_error is None
            else asdict(self.transfer_fit_error),
            # [prompt-token bin, decode-row bin, factor] (JSON has no tuple keys)
            "corrections": [[p, d, f] for (p, d), f in sorted(self.corrections.items())],
            # [step kind, history, factor]
            "transitions": [[k, h, f] for (k, h), f in sorted(self.transitions.items())],
            **dict(self.meta),
        }

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> FittedCost:
        own = {"kind", "name", "coefficients", "transfer", "fit_error", "transfer_fit_error", "corrections",
               "transitions", *SERVING_FIELDS}
        transfer = d.get("transfer") or {}
        return FittedCost(
            name=str(d["name"]),
            coefficients={str(k): float(v) for k, v in d["coefficients"].items()},
            transfer_t0_s=float(transfer.get("t0_s", 0.0)),
            transfer_per_block_s=float(transfer.get("per_block_s", 0.0)),
            fit_error=FitError(**d["fit_error"]) if d.get("fit_error") else None,
            transfer_fit_error=FitError(**d["transfer_fit_error"]) if d.get("transfer_fit_error") else None,
            corrections={(int(p), int(b)): float(f) for p, b, f in d.get("corrections") or []},
            transitions={(int(k), int(h)): float(f) for k, h, f in d.get("transitions") or []},
            **serving_of(d),
            meta={k: v for k, v in d.items() if k not in own},
        )


def fit_cost(
    name: str,
    train: Sequence[tuple[StepShape, float]],
    test: Sequence[tuple[StepShape, float]],
    features: Sequence[str] | None = None,
    **kwargs: Any,
) -> FittedCost:
    """Choose features on `train` (unless given), fit them on `train`, measure the error on `test`.
    `kwargs` go to FittedCost (transfer coefficients, meta)."""
    shapes, seconds = [s for s, _ in train], [t for _, t in train]
    names = list(features) if features is not None else select_features(shapes, seconds)
    coef = fit_coefficients(shapes, seconds, names)
    model = FittedCost(name, dict(zip(names, map(float, coef))), **kwargs)
    error = None
    if test:
        error = FitError.of([model.step_seconds(s) for s, _ in test], [t for _, t in test], len(train))
    return FittedCost(name, model.coefficients, fit_error=error, **kwargs)


def fit_transfer(blocks: Sequence[int], seconds: Sequence[float]) -> tuple[float, float, FitError]:
    """(t0, per block, in-sample error) of t = t0 + per_block * blocks, non-negative, relative error."""
    t = np.asarray(seconds, dtype=np.float64)
    x = np.column_stack([np.ones_like(t), np.asarray(blocks, dtype=np.float64)])
    t0, per_block = nnls(x / t[:, None], np.ones_like(t))
    error = FitError.of(list(x @ np.array([t0, per_block])), list(t), len(t))
    return float(t0), float(per_block), error


# -- the roofline model ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What a roofline needs of a decoder-only transformer (query heads times head_dim is taken to be
    hidden_size, as in the Llama family)."""

    num_params: int
    num_layers: int
    hidden_size: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    vocab_size: int = 0  # 0: the logits matmul is counted as part of every token's, not per sampled row

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True, slots=True)
class Hardware:
    """One accelerator's spec numbers. The efficiencies are the fractions of peak a real engine
    reaches (1.0: the ideal roofline, a lower bound on step time)."""

    peak_flops: float  # FLOP/s of dense matmuls in the model's dtype
    memory_bandwidth: float  # bytes/s
    step_overhead_s: float  # per step: scheduling, launches, sampling, host round trip
    interconnect_bandwidth: float  # bytes/s between instances, for KV transfers
    transfer_latency_s: float = 0.0  # per transfer
    flops_efficiency: float = 1.0
    bandwidth_efficiency: float = 1.0


@dataclass(frozen=True, slots=True)
class RooflineCost(ServingTimes):
    """step = overhead + max(FLOPs / achieved FLOP/s, bytes / achieved bandwidth), where the bytes are
    every weight read once per step plus each request's KV read once (and the new tokens' KV written),
    and the FLOPs are 2 per weight per token plus attention's 4 * hidden per (query, key) pair per
    layer (causal pairs only, as flash attention computes them). Activations are ignored (small next to weights and KV at serving batch sizes)."""

    name: str
    model: ModelShape
    hardware: Hardware
    block_size: int = 16  # tokens per KV block, for transfer sizes
    note: str = ""
    # The front end and the engine loop (see FittedCost): a CPU host's figures, not the GPU's.
    delivery_s: float = 0.0
    ingress_s: float = 0.0
    loop_gap_s: float = 0.0
    co_run_penalty: float = 0.0  # GPUs are not shared between instances: 0 unless stated
    api_message_s: float = 0.0
    api_token_s: float = 0.0
    client_message_s: float = 0.0
    client_token_s: float = 0.0

    def flops(self, shape: StepShape) -> float:
        m = self.model
        logits = m.vocab_size * m.hidden_size
        dense = 2.0 * (m.num_params - logits) * shape.tokens
        # Logits are computed for the rows that sample: each request's last token, and each draft.
        sampled = shape.num_requests + shape.draft_tokens
        attention = 4.0 * m.hidden_size * m.num_layers * shape.attention_pairs
        return dense + 2.0 * logits * sampled + attention

    def bytes(self, shape: StepShape) -> float:
        m = self.model
        weights = m.num_params * m.dtype_bytes
        return float(weights + m.kv_bytes_per_token * (shape.context_tokens + shape.tokens))

    def compute_seconds(self, shape: StepShape) -> float:
        hw = self.hardware
        return self.flops(shape) / (hw.peak_flops * hw.flops_efficiency)

    def memory_seconds(self, shape: StepShape) -> float:
        hw = self.hardware
        return self.bytes(shape) / (hw.memory_bandwidth * hw.bandwidth_efficiency)

    def step_seconds(self, shape: StepShape, history: int | None = None) -> float:
        if shape.num_requests == 0:
            return 0.0
        return self.hardware.step_overhead_s + max(self.compute_seconds(shape), self.memory_seconds(shape))

    def transfer_seconds(self, num_blocks: int) -> float:
        if num_blocks <= 0:
            return 0.0
        hw = self.hardware
        size = num_blocks * self.block_size * self.model.kv_bytes_per_token
        return hw.transfer_latency_s + size / hw.interconnect_bandwidth

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": ROOFLINE,
            "name": self.name,
            "note": self.note,
            "block_size": self.block_size,
            **serving_dict(self),
            "model": asdict(self.model),
            "hardware": asdict(self.hardware),
        }

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> RooflineCost:
        return RooflineCost(
            name=str(d["name"]),
            model=ModelShape(**_known(ModelShape, d["model"])),
            hardware=Hardware(**_known(Hardware, d["hardware"])),
            block_size=int(d.get("block_size", 16)),
            note=str(d.get("note", "")),
            **serving_of(d),
        )


# What a model says about serving besides the steps: the front end, the engine loop, co-located instances.
FRONT_END_FIELDS = tuple(f.name for f in fields(FrontEndCpu))
SERVING_FIELDS = ("delivery_s", "ingress_s", "loop_gap_s", "co_run_penalty", *FRONT_END_FIELDS)


def serving_dict(model: FittedCost | RooflineCost) -> dict[str, float]:
    return {name: getattr(model, name) for name in SERVING_FIELDS}


def serving_of(d: Mapping[str, Any]) -> dict[str, float]:
    """The serving fields of a stored model (0 where a file predates them)."""
    return {name: float(d.get(name, 0.0)) for name in SERVING_FIELDS}


def _known(cls: type, values: Mapping[str, Any]) -> dict[str, Any]:
    """`values` checked against the dataclass's fields: an unknown key is a typo, not something to drop."""
    names = {f.name for f in fields(cls)}
    unknown = set(values) - names
    if unknown:
        raise ValueError(f"unknown {cls.__name__} fields {sorted(unknown)}; known: {sorted(names)}")
    return dict(values)


# -- files ----------------------------------------------------------------------------------------


def cost_from_dict(d: Mapping[str, Any]) -> FittedCost | RooflineCost:
    kind = d.get("kind")
    if kind == FITTED:
        return FittedCost.from_dict(d)
    if kind == ROOFLINE:
        return RooflineCost.from_dict(d)
    raise ValueError(f"cost model kind must be {FITTED!r} or {ROOFLINE!r}, got {kind!r}")


def load_cost(path: str | os.PathLike[str]) -> FittedCost | RooflineCost:
    """A cost model from its JSON file (see `save_cost`)."""
    with open(path) as f:
        try:
            d = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{os.fspath(path)} is not valid JSON: {exc}") from exc
    try:
        return cost_from_dict(d)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{os.fspath(path)} is not a cost model: missing or bad field {exc!r}") from exc


def save_cost(model: FittedCost | RooflineCost, path: str | os.PathLike[str]) -> None:
    os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(model.to_dict(), f, indent=2, allow_nan=False)
        f.write("\n")


def shipped_cost_path(name: str) -> str:
    """The path of a cost model shipped in tandem/sim/costs (`name` without .json)."""
    return os.path.join(os.path.dirname(__file__), "costs", f"{name}.json")
