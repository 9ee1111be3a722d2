"""What an engine ran just before a step, as far as the step's cost depends on it.

On a CPU a step's time depends on what the one before left in the caches, not only on its own
shape. Served steps of the default model on the Sapphire Rapids VM, against a model of their
shapes alone: the first decode step after a prompt chunk ran 1.10x, the second 1.06x and later
ones 0.94x; a prompt chunk of 256 tokens or more straight after another one 0.94x, after decode
steps 1.00x. A memoryless model averages these, which is right on the whole and wrong for a burst
of prompts (its chunks run back to back, each cheaper than the average says) and for the decode
steps between chunks. So a step is also classed by its kind (`kind`: decode only, a small prompt
chunk, a large one) and its history (`StepHistory`: after an idle engine, straight after a small
or a large chunk, second after a chunk, later), and a fitted model may keep a factor per class
(`FittedCost.transitions`, fitted on served steps by `tandem.sim.calibrate`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tandem.core.step_shape import StepShape
from tandem.engine.step_trace import BUSY_GAP_S, line_shape

# Step kinds.
DECODE = 0
SMALL_PROMPT = 1
LARGE_PROMPT = 2
# Prompt tokens in a step from which it counts as a large prompt chunk.
LARGE_PROMPT_TOKENS = 256

# Histories.
IDLE = 0  # the engine sat idle before it (BUSY_GAP_S or more since its last step ended)
AFTER_SMALL_PROMPT = 1  # straight after a step with a small prompt chunk
AFTER_LARGE_PROMPT = 2  # straight after a step with a large one
SECOND_AFTER_PROMPT = 3  # the second step after one with a prompt chunk
STEADY = 4  # later, or no prompt chunk since the engine last sat idle


def kind(shape: StepShape) -> int:
    if shape.prefill_tokens <= 0:
        return DECODE
    return LARGE_PROMPT if shape.prefill_tokens >= LARGE_PROMPT_TOKENS else SMALL_PROMPT


class StepHistory:
    """One engine's recent steps: `before(start)` classes the step starting then, `after(shape,
    end)` records one that ended."""

    __slots__ = ("_last_end", "_last_kind", "_since_prompt")

    def __init__(self) -> None:
        self._last_kind = DECODE
        self._since_prompt = 2  # steps since the last prompt chunk, counted up to 2
        self._last_end: float | None = None

    def before(self, start: float) -> int:
        if self._last_end is None or start - self._last_end >= BUSY_GAP_S:
            return IDLE
        if self._since_prompt == 0:
            return AFTER_LARGE_PROMPT if self._last_kind == LARGE_PROMPT else AFTER_SMALL_PROMPT
        return SECOND_AFTER_PROMPT if self._since_prompt == 1 else STEADY

    def after(self, shape: StepShape, end: float) -> None:
        step_kind = kind(shape)
        self._since_prompt = 0 if step_kind != DECODE else min(2, self._since_prompt + 1)
        self._last_kind = step_kind
        self._last_end = end


def histories(lines: Sequence[dict[str, Any]]) -> list[int]:
    """The history of each line of a step trace (several engines may share the file: each line's
    history is its own engine's), in the lines' order."""
    order = sorted(range(len(lines)), key=lambda i: (lines[i]["pid"], float(lines[i]["start"])))
    out = [STEADY] * len(lines)
    engines: dict[Any, StepHistory] = {}
    for i in order:
        line = lines[i]
        history = engines.setdefault(line["pid"], StepHistory())
        start = float(line["start"])
        out[i] = history.before(start)
        history.after(line_shape(line), start + float(line["seconds"]))
    return out
