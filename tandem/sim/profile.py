"""Measure what engine steps of a model cost on this machine and fit a `FittedCost` to them.

Each timed step is a real `EngineCore.step()`: scheduling, the runner's forward and sampling, the
scheduler's update and the outputs, as a serving engine pays them. The profiler only chooses what
the scheduler is given so that the steps take the shapes of a grid:

- decode batches: N requests with L tokens of context join the engine as migrated requests do
  (`EngineCore.install`, their KV blocks written with random values; see `Prober.install`), then
  decode steps are timed at N rows; requests are aborted down to the next, smaller N (the context
  grows by a few tokens meanwhile: every point carries the shape its step really had, `shape_of`);
- mixed steps: a new prompt of C tokens joins a decoding batch, the token budget set to take it
  whole in the same step;
- prompts at context 0 computed in one step, several prompts in one step, and a long prompt
  computed in fixed-size chunks (each chunk reading the context of the ones before it).

The token budget is set per step by changing the scheduler's `max_num_batched_tokens`. Prefix
caching is off and prompts are random, so no step reuses another's KV. The grid is timed in several
passes; each point is the median of its steps over all of them. A quarter of the points (chosen at
random, seeded) is held out: the model is fitted on the rest, so its `fit_error` is the error of the
coefficients it ships with, on shapes it did not see. KV transfers are timed over Tandem's own path: the runner's
`read_blocks`, a zmq transport over ipc:// to a second one in this process, and `write_blocks`.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandem.core.step_shape import StepShape, shape_of
from tandem.sim.cost import FRONT_END_FIELDS, FittedCost, fit_cost, fit_transfer, save_cost

if TYPE_CHECKING:
    from tandem.engine.core import EngineCore
    from tandem.sampling_params import SamplingParams

# The serving fields `time_front_end` measures (the co-run penalty comes from calibrate_co_run).
TIMED_FIELDS = ("delivery_s", "ingress_s", "loop_gap_s", *FRONT_END_FIELDS)


@dataclass(frozen=True, slots=True)
class Grid:
    """The shapes a profile times. Lengths past the model's `max_model_len` are left out."""

    decode_contexts: tuple[int, ...]  # prompt lengths of the decoding batches
    decode_rows: tuple[int, ...]  # batch sizes timed at each context, largest first
    mixed_rows: tuple[int, ...]  # batch sizes at which a prompt joins the decodes...
    mixed_chunks: tuple[int, ...]  # ...with these many tokens
    prefill_chunks: tuple[int, ...]  # prompts computed whole in one step, at context 0
    batched_prompts: tuple[tuple[int, int], ...]  # (count, length): several prompts in one step
    chunked_prompt: int  # a prompt computed in chunks of each of `chunk_sizes`...
    chunk_sizes: tuple[int, ...]  # ...(each chunk after the first reads the ones before it)
    passes: int  # times the whole grid is timed; each point is the median over all its steps
    decode_repeats: int  # decode steps timed per point and pass (a prompt's step is timed once a pass)
    transfer_blocks: tuple[int, ...]  # KV transfer sizes timed, in blocks


# About two minutes on the default model, one thread (plus loading and warming the engine).
DEFAULT_GRID = Grid(
    decode_contexts=(32, 256, 1024, 1792),
    decode_rows=(64, 48, 32, 24, 16, 12, 8, 6, 4, 3, 2, 1),
    mixed_rows=(32, 4),
    mixed_chunks=(32, 256, 1024),
    prefill_chunks=(16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048),
    batched_prompts=((2, 512), (4, 128), (8, 64), (16, 32), (8, 256)),
    chunked_prompt=2048,
    chunk_sizes=(128, 512),
    passes=3,
    decode_repeats=2,
    transfer_blocks=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
)
# About twenty seconds: for tests, and a first look at a new machine.
QUICK_GRID = Grid(
    decode_contexts=(32, 256, 768),
    decode_rows=(32, 16, 8, 4, 2, 1),
    mixed_rows=(8,),
    mixed_chunks=(64, 512),
    prefill_chunks=(16, 64, 256, 512, 1024),
    batched_prompts=((4, 64),),
    chunked_prompt=1024,
    chunk_sizes=(256,),
    passes=3,
    decode_repeats=2,
    transfer_blocks=(1, 4, 16, 64, 256),
)
# Untimed steps a decoding batch takes at each new size before its steps are timed: the first
# steps after the mixed steps (a prompt of up to 1024 tokens joined the batch) run slower than the
# same batch later on, and timing them would charge that to the batch's shape (docs/simulator.md, (b)).
SETTLE_STEPS = 3
# Share of the points held out of the fit to report its error, and the seed that picks them.
HELD_OUT_FRACTION = 0.25
SPLIT_SEED = 0
# Prompt token ids are drawn from [FIRST_TOKEN_ID, vocab): clear of the usual special tokens.
FIRST_TOKEN_ID = 16


@dataclass(frozen=True, slots=True)
class Point:
    shape: StepShape
    seconds: float  # the median of its steps
    probe: str  # which part of the grid it came from
    steps: int  # how many steps were timed
    # The median absolute deviation of its steps' times, in % of the median: how much steps of one
    # shape varied (timer noise, other processes on the machine).
    spread: float


class Prober:
    """Drives an EngineCore and times its steps, each with the shape `shape_of` gives its plan."""

    def __init__(self, core: EngineCore, decode_repeats: int, temperature: float, seed: int) -> None:
        import torch

        self.core = core
        self.decode_repeats = decode_repeats
        self.temperature = temperature
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.vocab = core.model_config.vocab_size
        # probe -> its timed steps so far (over every pass), in the order first timed
        self.runs: dict[str, list[tuple[StepShape, float]]] = {}
        self._last_shape: StepShape | None = None
        self._next_id = 0

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Catch each step's plan as the scheduler hands it out (before `update` changes the counts)."""
        sched = self.core.scheduler
        original = sched.schedule

        def schedule() -> Any:
            out = original()
            self._last_shape = shape_of(out)
            return out

        sched.schedule = schedule  # type: ignore[method-assign]
        try:
            yield
        finally:
            del sched.schedule  # the instance attribute goes; the class's method shows again

    def step(self) -> tuple[StepShape, float]:
        start = time.perf_counter()
        self.core.step()
        seconds = time.perf_counter() - start
        shape, self._last_shape = self._last_shape, None
        if shape is None or shape.num_requests == 0:
            raise RuntimeError(f"a timed step computed nothing ({shape}): the profile's grid is off")
        return shape, seconds

    def budget(self, tokens: int) -> None:
        self.core.scheduler.max_num_batched_tokens = tokens

    def _new_id(self) -> str:
        self._next_id += 1
        return f"profile-{self._next_id}"

    def prompt(self, length: int) -> list[int]:
        """Random tokens: no two prompts share a prefix."""
        return [self.rng.randrange(FIRST_TOKEN_ID, self.vocab) for _ in range(length)]

    def params(self, max_tokens: int) -> SamplingParams:
        from tandem.sampling_params import SamplingParams

        return SamplingParams(temperature=self.temperature, ignore_eos=True, max_tokens=max_tokens)

    def add(self, prompt_len: int, max_tokens: int) -> str:
        """A new request, admitted as any other."""
        from tandem.core.engine_io import EngineCoreRequest

        rid = self._new_id()
        req = EngineCoreRequest(
            rid, self.prompt(prompt_len), self.params(max_tokens), max_tokens, time.monotonic()
        )
        self.core.add_request(req)
        return rid

    def keep(self, probe: str, runs: Sequence[tuple[StepShape, float]]) -> None:
        self.runs.setdefault(probe, []).extend(runs)

    def points(self) -> list[Point]:
        """One point per probe: the median time of its steps (over every pass), the middle shape (a
        decode batch's context grows a little from step to step)."""
        out = []
        for probe, runs in self.runs.items():
            shape = sorted(runs, key=lambda r: r[0].context_tokens)[len(runs) // 2][0]
            median = statistics.median(t for _, t in runs)
            spread = 100 * statistics.median(abs(t - median) for _, t in runs) / median
            out.append(Point(shape, median, probe, len(runs), spread))
        return out

    def drain(self) -> None:
        while self.core.has_unfinished_requests():
            self.core.step()

    # -- the grid's probes -------------------------------------------------------------------

    def prefill(self, length: int, count: int = 1) -> None:
        """`count` prompts of `length` tokens computed together in one step, at context 0."""
        self.budget(length * count)
        for _ in range(count):
            self.add(length, 1)
        self.keep(f"prefill {count}x{length}", [self.step()])
        self.drain()

    def chunked(self, length: int, chunk: int) -> None:
        """A prompt of `length` computed `chunk` tokens a step: one point per chunk position."""
        self.budget(chunk)
        self.add(length, 1)
        i = 0
        while self.core.has_unfinished_requests():
            self.keep(f"chunk {i} ({chunk} tokens) of {length}", [self.step()])
            i += 1

    def install(self, context: int, count: int, max_tokens: int) -> list[str]:
        """`count` requests decoding at `context`, arriving as a migrated request does (`install`):
        `context` tokens of KV computed elsewhere, one sampled token to compute next.

        Computing their prompts here instead would cost most of the profile's time (64 prompts of
        1.8k tokens are minutes on one CPU thread) and measure nothing the prefill probes do not. A
        decode step's cost does not depend on the KV's values, only on its size and that it is real,
        distinct memory: every block is written (random values) before it is read."""
        import torch

        from tandem.core.engine_io import EngineCoreRequest
        from tandem.kvtransfer.protocol import SampleState

        core, kv = self.core, self.core.kv
        ids = []
        for _ in range(count):
            rid = self._new_id()
            req = EngineCoreRequest(rid, self.prompt(context), self.params(max_tokens), max_tokens, 0.0)
            blocks = core.reserve_blocks(kv.blocks_for(context + 1))
            if blocks is None:
                raise RuntimeError(
                    f"no room for {count} requests of {context} tokens; the grid outgrew the cache"
                )
            core.install(req, [SampleState(self.prompt(1), context, blocks, [])])
            core.drop_blocks(blocks)  # the request holds them now
            ids.append(rid)
        index = torch.tensor([b for r in core.scheduler.running for b in r.block_ids])
        runner = core.runner
        mc = core.model_config
        for cache in runner.kv_caches:
            values = torch.randn(2, 1, *cache.shape[2:4], mc.head_dim, generator=self.gen)
            cache[:, index] = runner.kv_format.quantize(values)  # the cache's own format, scales and all
        return ids

    def decode(
        self, context: int, rows: Sequence[int], mixed_rows: Sequence[int], chunks: Sequence[int]
    ) -> None:
        """Decode steps of batches of each size in `rows` at `context`, and prompts joining them."""
        # The sampled token they arrive with counts toward max_tokens: one more, so none finishes.
        ids = self.install(context, rows[0], 1 + decode_steps(rows, mixed_rows, chunks, self.decode_repeats))
        for n in rows:
            self.core.abort_requests(ids[n:])
            ids = ids[:n]
            self.budget(n)
            for _ in range(SETTLE_STEPS):  # untimed: the first steps at a batch size
                self.core.step()
            self.keep(f"decode {n} at {context}", [self.step() for _ in range(self.decode_repeats)])
            if n in mixed_rows:
                for c in chunks:
                    self.budget(n + c)
                    self.add(c, 1)
                    self.keep(f"decode {n} at {context} + prompt {c}", [self.step()])
        self.core.abort_requests(ids)
        self.drain()


def decode_steps(rows: Sequence[int], mixed_rows: Sequence[int], chunks: Sequence[int], repeats: int) -> int:
    """Steps a decoding batch takes in one pass (`Prober.decode`): what its requests' contexts grow by."""
    return len(rows) * (SETTLE_STEPS + repeats) + sum(len(chunks) for n in rows if n in mixed_rows)


def engine_for(model_path: str, grid: Grid, threads: int, dtype: str) -> EngineCore:
    """An engine with room for the grid: seats for its largest batch, blocks for every phase."""
    from tandem.config import EngineConfig
    from tandem.engine.core import EngineCore

    block_size = 16
    blocks = lambda tokens: -(-tokens // block_size)
    rows = max(grid.decode_rows)
    steps = decode_steps(grid.decode_rows, grid.mixed_rows, grid.mixed_chunks, grid.decode_repeats)
    longest_context = max(grid.decode_contexts, default=0) + steps + 1
    longest_prompt = max([*grid.prefill_chunks, grid.chunked_prompt, *grid.mixed_chunks])
    need = max(
        rows * blocks(longest_context) + blocks(max(grid.mixed_chunks, default=0)),
        blocks(longest_prompt),
        max((c * blocks(n) for c, n in grid.batched_prompts), default=0),
        2 * max(grid.transfer_blocks, default=0),
    )
    config = EngineConfig(
        model=model_path,
        dtype=dtype,
        num_threads=threads,
        max_num_seqs=rows + max((c for c, _ in grid.batched_prompts), default=1),
        max_num_batched_tokens=max(2048, longest_prompt),
        block_size=block_size,
        num_kv_blocks=need,
        enable_prefix_caching=False,
    )
    return EngineCore(config)


def fit_grid(grid: Grid, max_model_len: int) -> Grid:
    """The grid within the model's context: prompts cut to the longest that fits (a 2048 grid on a
    2048-token model times 2047-token prompts), decode contexts that leave no room left out."""
    longest = max_model_len - 1  # a prompt and the one token it samples
    steps = decode_steps(grid.decode_rows, grid.mixed_rows, grid.mixed_chunks, grid.decode_repeats)
    cut = lambda lengths: tuple(dict.fromkeys(min(n, longest) for n in lengths))
    chunked = min(grid.chunked_prompt, longest)
    return replace(
        grid,
        decode_contexts=tuple(c for c in grid.decode_contexts if c + steps < max_model_len),
        mixed_chunks=cut(grid.mixed_chunks),
        prefill_chunks=cut(grid.prefill_chunks),
        batched_prompts=tuple(dict.fromkeys((c, min(n, longest)) for c, n in grid.batched_prompts)),
        chunked_prompt=chunked,
        chunk_sizes=tuple(c for c in grid.chunk_sizes if c < chunked),
    )


def run_pass(prober: Prober, grid: Grid) -> None:
    """Every probe of the grid once; the prompts first, so the row counts of big batches are warm by
    the time they come up again."""
    for n in grid.prefill_chunks:
        prober.prefill(n)
    for count, n in grid.batched_prompts:
        prober.prefill(n, count)
    for chunk in grid.chunk_sizes:
        prober.chunked(grid.chunked_prompt, chunk)
    for context in grid.decode_contexts:
        prober.decode(context, grid.decode_rows, grid.mixed_rows, grid.mixed_chunks)


def warm_up(prober: Prober, grid: Grid) -> None:
    """An untimed longest prompt and a decode batch: the first steps after loading pay one-time costs
    (allocator growth, lazily built kernels, cold caches) that belong to no shape."""
    if grid.prefill_chunks:
        prober.prefill(max(grid.prefill_chunks))
    if grid.decode_contexts:
        prober.decode(min(grid.decode_contexts), grid.decode_rows[:1], (), ())
    prober.runs.clear()


def run_grid(prober: Prober, grid: Grid, progress: Callable[[str], None]) -> None:
    """`grid.passes` passes over the grid. Repeats a pass apart, not back to back: on a shared
    machine the load changes over seconds, and a point timed only during a busy spell would be off
    by the whole spell; the median over passes is not."""
    start = time.perf_counter()
    warm_up(prober, grid)
    for i in range(grid.passes):
        run_pass(prober, grid)
        progress(
            f"pass {i + 1}/{grid.passes}: {len(prober.runs)} points, {time.perf_counter() - start:.0f} s"
        )


def time_transfers(core: EngineCore, counts: Sequence[int], repeats: int) -> list[tuple[int, float]]:
    """(blocks, seconds) of KV transfers between two zmq transports in this process, through the
    runner's own read and write of blocks, in messages of Tandem's size. Sender and receiver take
    turns here (two engines would overlap them), so this is the sum of both ends' work."""
    from tandem.kvtransfer.transport import MAX_PAYLOAD_BYTES, make_transport

    runner = core.runner
    block_bytes = runner.kv_bytes_per_block(core.model_config, core.kv.block_size, runner.kv_format)
    per_message = max(1, MAX_PAYLOAD_BYTES // block_bytes)
    out = []
    with tempfile.TemporaryDirectory(prefix="tandem-profile-") as tmp:
        sender = make_transport("zmq", f"ipc://{tmp}/send")
        receiver = make_transport("zmq", f"ipc://{tmp}/recv")
        try:
            for n in counts:
                src, dst = list(range(n)), list(range(n, 2 * n))
                times = []
                for _ in range(repeats + 1):  # the first one warms the sockets and buffers up
                    start = time.perf_counter()
                    held = []
                    for i in range(0, n, per_message):
                        data = runner.read_blocks(src[i : i + per_message])
                        held.append(data)  # zmq sends without a copy: alive until received
                        sender.send(receiver.address, b"kv", data)
                    for i in range(0, n, per_message):
                        msg = _receive(receiver)
                        assert msg.payload is not None
                        runner.write_blocks(dst[i : i + per_message], msg.payload)
                        msg.release()
                    times.append(time.perf_counter() - start)
                out.append((n, statistics.median(times[1:])))
        finally:
            sender.close()
            receiver.close()
    return out


def _receive(transport: Any, timeout_s: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        msg = transport.recv()
        if msg is not None:
            return msg
        transport.socket.poll(10)
    raise RuntimeError(f"a KV message sent to this process did not arrive within {timeout_s} s")


def split(points: Sequence[Point], fraction: float, seed: int) -> tuple[list[Point], list[Point]]:
    """(train, held out): `fraction` of the points, picked at random with `seed`."""
    order = list(range(len(points)))
    random.Random(seed).shuffle(order)
    k = round(len(points) * fraction)
    test = set(order[:k])
    return [p for i, p in enumerate(points) if i not in test], [p for i, p in enumerate(points) if i in test]


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    import torch

    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def profile_model(
    model_path: str,
    out_path: str | None = None,
    *,
    threads: int = 1,
    quick: bool = False,
    grid: Grid | None = None,
    dtype: str = "auto",
    temperature: float = 1.0,
    seed: int = 0,
    note: str = "",
    delivery: bool = False,
    progress: Callable[[str], None] | None = None,
) -> FittedCost:
    """Time engine steps of the model at `model_path` over `grid` (QUICK_GRID with `quick`, else
    DEFAULT_GRID), fit a FittedCost and its transfer cost, write it to `out_path` if given.

    `temperature` is the requests' (1.0, the API's default: sampling costs a little more than greedy);
    `threads` the engine's torch threads; `delivery` also times the front end and the engine loop
    through a real server at light load (`time_front_end`, about a minute more)."""
    say = progress or (lambda _: None)
    start = time.perf_counter()
    label = "custom" if grid is not None else "quick" if quick else "default"
    grid = fit_grid(grid or (QUICK_GRID if quick else DEFAULT_GRID), _max_len(model_path))
    core = engine_for(model_path, grid, threads, dtype)
    say(f"engine ready in {time.perf_counter() - start:.1f} s")
    prober = Prober(core, grid.decode_repeats, temperature, seed)
    with prober.recording():
        run_grid(prober, grid, say)
    transfers = time_transfers(
        core, [n for n in grid.transfer_blocks if 2 * n <= core.num_blocks], grid.passes
    )
    t0, per_block, transfer_error = fit_transfer([n for n, _ in transfers], [t for _, t in transfers])
    points = prober.points()
    train, test = split(points, HELD_OUT_FRACTION, SPLIT_SEED)
    held_out = {id(p) for p in test}
    mc = core.model_config
    meta = {
        "note": note,
        "model": _model_name(model_path) if _is_default(model_path) else model_path,
        "model_shape": {
            "hidden_size": mc.hidden_size,
            "num_layers": mc.num_layers,
            "num_kv_heads": mc.num_kv_heads,
            "head_dim": mc.head_dim,
            "vocab_size": mc.vocab_size,
        },
        "dtype": str(core.runner.dtype).removeprefix("torch."),
        "threads": threads,
        "temperature": temperature,
        "block_size": core.kv.block_size,
        "machine": machine(),
        "measured_on": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
        "profile_seconds": round(time.perf_counter() - start, 1),
        "grid": label,
        # How much steps of one shape varied (the median over points of Point.spread): the timer
        # noise under the fit error.
        "noise_percent": round(statistics.median(p.spread for p in points), 2),
        # Every point, so the model can be refitted or checked: shape fields, then the rest.
        "points": {
            "columns": [*StepShape.__dataclass_fields__, "seconds", "held_out", "steps", "spread", "probe"],
            "rows": [
                [*_shape_row(p.shape), p.seconds, id(p) in held_out, p.steps, round(p.spread, 2), p.probe]
                for p in points
            ],
        },
        "transfers": [[n, t] for n, t in transfers],
    }
    front: dict[str, float] = {}
    if delivery:
        timed = time_front_end(model_path, threads, dtype)
        front = {k: timed[k] for k in TIMED_FIELDS}
        meta["front_end"] = {k: round(v, 6) if isinstance(v, float) else v for k, v in timed.items()}
        say(
            f"front end: ingress {front['ingress_s'] * 1e3:.2f} ms, delivery {front['delivery_s'] * 1e3:.2f} ms,"
            f" engine loop gap {front['loop_gap_s'] * 1e3:.2f} ms per step; CPU per output message + per token:"
            f" API process {front['api_message_s'] * 1e3:.3f} ms + {front['api_token_s'] * 1e6:.0f} us,"
            f" client {front['client_message_s'] * 1e3:.3f} ms + {front['client_token_s'] * 1e6:.0f} us"
        )
    name = f"{_model_name(model_path)}-{meta['dtype']}-{threads}thread"
    serving: dict[str, Any] = {k: front.get(k, 0.0) for k in TIMED_FIELDS}
    model = fit_cost(
        name,
        [(p.shape, p.seconds) for p in train],
        [(p.shape, p.seconds) for p in test],
        transfer_t0_s=t0,
        transfer_per_block_s=per_block,
        transfer_fit_error=transfer_error,
        meta=meta,
        **serving,
    )
    if out_path is not None:
        save_cost(model, out_path)
    return model


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far, all its threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def split_front_end_cpu(light: tuple[int, int, float], busy: tuple[int, int, float]) -> tuple[float, float]:
    """Seconds per output message and per token from the front end's CPU at two loads, each given as
    (messages, tokens, CPU seconds): at light load nearly every message carries one token, under
    load many, which tells the two apart. A split the figures cannot carry (a negative part, or
    loads too alike) puts it all on the one that fits."""
    (m1, t1, c1), (m2, t2, c2) = light, busy
    det = m1 * t2 - m2 * t1
    if abs(det) > 1e-9 * max(1.0, m1 * t2):
        per_message, per_token = (c1 * t2 - c2 * t1) / det, (m1 * c2 - m2 * c1) / det
        if per_message >= 0 and per_token >= 0:
            return per_message, per_token
    return 0.0, (c1 + c2) / (t1 + t2) if t1 + t2 > 0 else 0.0


def time_front_end(
    model_path: str, threads: int = 1, dtype: str = "auto", requests: int = 100, rate: float = 5.0, seed: int = 0,
    busy_rate: float = 100.0,
) -> dict[str, Any]:
    """The front end's and the engine loop's times, through a real `tandem serve` of the model, with
    the load generator `tandem bench serve` uses (its HTTP client is part of what a client sees).

    Replays `requests` streaming completions (Poisson arrivals at `rate` per second, prompts of
    32-512 token ids, 16-64 output tokens) and reads the server's histograms and step trace.
    `rate` is light but not idle: at 1 request a second the processes sleep between requests and
    each hop pays a wake-up (the default model's delivery 4.7-5.5 ms at 1 req/s, 3.8 at 5, 3.3 at
    20, where the engine starts to queue the way in).
    `delivery_s` is the client's mean time to first token minus the server's (the HTTP hop both
    ways, parsing, the first token's way out); `ingress_s` the mean time from the API process
    taking a request in to its first step, over the requests that found the engine idle (the way
    in, not a queue); `loop_gap_s` the mean time between busy steps. Then as many
    requests again at `busy_rate`, where each step's output message carries many tokens: the CPU
    time of the API process and of the client at the two loads, against the steps (one output
    message each) and tokens, gives each one's seconds per message and per token (`api_message_s`,
    `api_token_s`, `client_message_s`, `client_token_s`). Returns them with the raw figures."""
    import argparse
    import io

    from tandem.engine.step_trace import idle_arrival_waits, loop_gaps, read_step_trace
    from tandem.loadgen.serve import add_serve_bench_args, run_bench
    from tandem.loadgen.server_process import ServerProcess
    from tandem.sim.trace import save_trace, synthetic

    traces = {
        "light": synthetic(requests, rate, prompt_len=(32, 512), output_len=(16, 64), seed=seed),
        "busy": synthetic(requests, busy_rate, prompt_len=(32, 512), output_len=(16, 64), seed=seed + 1),
    }
    phases: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        steps_path = os.path.join(tmp, "steps.jsonl")
        paths = {name: os.path.join(tmp, f"{name}.jsonl") for name in traces}
        for name, trace in traces.items():
            save_trace(trace, paths[name])
        args = ["--num-threads", str(threads), "--dtype", dtype, "--served-model-name", "m"]
        with ServerProcess(model_path, *args, "--step-trace", steps_path, startup_timeout=600) as server:

            def replay(name: str, num: int) -> dict[str, Any]:
                p = argparse.ArgumentParser()
                add_serve_bench_args(p)
                bench = p.parse_args(
                    ["--base-url", server.url, "--model", "m", "--tokenizer", model_path, "--dataset", "trace",
                     "--dataset-path", paths[name], "--num-prompts", str(num), "--ignore-eos",
                     "--disable-tqdm", "--num-warmups", "0"]
                )
                with contextlib.redirect_stdout(io.StringIO()):
                    return dict(run_bench(bench)["runs"][0])

            def cpu() -> tuple[float, float]:
                return process_cpu_seconds(server.proc.pid), process_cpu_seconds(os.getpid())

            # A warm-up replay first: the server's histograms and step trace are read from after it,
            # so its first (slower) requests count on neither side.
            replay("light", 2)
            before = server.metrics()
            for name in traces:
                since, cpu0 = time.monotonic(), cpu()
                run = replay(name, requests)
                cpu1 = cpu()
                phases[name] = {"run": run, "since": since, "until": time.monotonic(),
                                "api_cpu_s": cpu1[0] - cpu0[0], "client_cpu_s": cpu1[1] - cpu0[1]}
                if name == "light":
                    after = server.metrics()
            server.stop()
        lines = read_step_trace(steps_path)
    for phase in phases.values():
        phase["lines"] = [line for line in lines if phase["since"] <= line["start"] < phase["until"]]
    gaps = loop_gaps(phases["light"]["lines"])

    def mean_of(name: str) -> float:
        count = after.get(f"tandem:{name}_seconds_count", 0.0) - before.get(f"tandem:{name}_seconds_count", 0.0)
        if not count:
            raise RuntimeError(f"the server reported no {name} (no request finished?)")
        total = after[f"tandem:{name}_seconds_sum"] - before.get(f"tandem:{name}_seconds_sum", 0.0)
        return total / count

    def load(name: str, process: str) -> tuple[int, int, float]:
        phase = phases[name]
        return len(phase["lines"]), int(phase["run"]["total_output_tokens"]), float(phase[f"{process}_cpu_s"])

    split = {p: split_front_end_cpu(load("light", p), load("busy", p)) for p in ("api", "client")}
    client_ttft = phases["light"]["run"]["ttft_ms"]["mean"] / 1e3
    server_ttft = mean_of("time_to_first_token")
    # The way in: requests that reached an idle engine (a request that arrives during a step also
    # waits for the step's rest, which the simulator schedules itself; on a slow machine that is
    # most of the queue time). Without such requests, the mean queue time.
    queue = mean_of("request_queue_time")
    idle = idle_arrival_waits(phases["light"]["lines"])
    return {
        "delivery_s": max(0.0, client_ttft - server_ttft),
        "ingress_s": statistics.fmean(idle) if idle else queue,
        "queue_s": queue,
        "idle_arrivals": len(idle),
        "loop_gap_s": statistics.fmean(gaps) if gaps else 0.0,
        **{f"{p}_message_s": split[p][0] for p in split},
        **{f"{p}_token_s": split[p][1] for p in split},
        "client_ttft_s": client_ttft,
        "server_ttft_s": server_ttft,
        "requests": requests,
        "rate": rate,
        "busy_rate": busy_rate,
        "loop_gaps": len(gaps),
        **{f"{name}_{p}_messages_tokens_cpu_s": list(load(name, p)) for name in phases for p in split},
    }


def _shape_row(shape: StepShape) -> list[int]:
    return [getattr(shape, f) for f in StepShape.__dataclass_fields__]


def _max_len(model_path: str) -> int:
    from tandem.config import ModelConfig

    return ModelConfig.from_pretrained(model_path).max_position_embeddings


def _is_default(model_path: str) -> bool:
    """The embedded default model (its path differs from one install to the next)."""
    from pathlib import Path

    from tandem.checkpoints import DEFAULT_MODEL_DIR

    return Path(model_path).resolve() == DEFAULT_MODEL_DIR.resolve()


def _model_name(model_path: str) -> str:
    from pathlib import Path

    return "default" if _is_default(model_path) else Path(model_path).resolve().name


def describe(model: FittedCost) -> str:
    """The coefficients and errors, for people."""
    units = {
        "const": "ms per step",
        "multi_row": "ms per step of more than one token",
        "big_step": "ms per step past the tile kernel's rows",
        "tokens": "us per token",
        "logit_rows": "us per sampled row",
        "prompt_chunks": "us per prompt chunk",
        "requests": "us per request",
        "context_tokens": "ns per context token",
        "extra_attention": "ns per (query, key) pair",
    }
    scale = {"const": 1e3, "multi_row": 1e3, "big_step": 1e3, "context_tokens": 1e9, "extra_attention": 1e9}
    lines = [f"cost model {model.name}"]
    for n, c in model.coefficients.items():
        lines.append(f"  {n:16s} {c * scale.get(n, 1e6):10.4f} {units[n]}")
    lines.append(
        f"  transfer         {model.transfer_t0_s * 1e3:.3f} ms + {model.transfer_per_block_s * 1e6:.2f} us per block"
    )
    if model.fit_error is not None:
        e = model.fit_error
        lines.append(
            f"  fit error on {e.num_test} held-out shapes ({e.num_train} fitted): "
            f"mean {e.mape:.1f}%, P90 {e.p90:.1f}%, max {e.max:.1f}%"
        )
    if model.corrections:
        factors = model.corrections.values()
        lines.append(
            f"  shape corrections: {len(model.corrections)} cells of (prompt tokens, decode rows),"
            f" factors {min(factors):.2f}-{max(factors):.2f} on the linear seconds"
        )
    if model.transitions:
        factors = model.transitions.values()
        lines.append(
            f"  step history: {len(model.transitions)} (step kind, what ran before) classes,"
            f" factors {min(factors):.2f}-{max(factors):.2f} on top"
        )
    noise = model.meta.get("noise_percent")
    if noise is not None:
        lines.append(f"  timer noise: steps of one shape varied by {noise:.1f}% (median absolute deviation)")
    if model.transfer_fit_error is not None:
        e = model.transfer_fit_error
        lines.append(f"  transfer fit error: mean {e.mape:.1f}%, P90 {e.p90:.1f}%")
    if model.delivery_s or model.ingress_s or model.loop_gap_s:
        lines.append(
            f"  front end: a request reaches the engine {model.ingress_s * 1e3:.2f} ms after it arrives,"
            f" a token its client {model.delivery_s * 1e3:.2f} ms after its step;"
            f" the engine loop spends {model.loop_gap_s * 1e3:.2f} ms between steps"
        )
    cpu = model.front_end_cpu()
    if cpu.measured:
        lines.append(
            f"  front-end CPU per output message + per token: API process {cpu.api_message_s * 1e3:.3f} ms"
            f" + {cpu.api_token_s * 1e6:.0f} us, client {cpu.client_message_s * 1e3:.3f} ms"
            f" + {cpu.client_token_s * 1e6:.0f} us (queued: tandem.sim.frontend)"
        )
    if model.co_run_penalty:
        lines.append(
            f"  co-run penalty: each other instance running on the host makes a step {model.co_run_penalty:.0%} longer"
        )
    return "\n".join(lines)
