"""A cost line `y = a + b*x` (seconds for `x` tokens or requests), for the adaptive controller."""

from __future__ import annotations

from collections.abc import Sequence


class LinearCost:
    """`y = a + b*x`, fitted by exponentially weighted least squares.

    With a shape measured up front (`set_shape`), online samples only rescale it: `y = s*(a0 + b0*x)`,
    `s` the decayed ratio of observed to shape-predicted costs. Online samples of a decoding batch
    barely vary `x` (a step of one request computes 1 to 1 + k tokens) while the machine's speed
    drifts, so a slope fitted online from them is mostly noise; the shape's slope comes from a wide
    range of `x` timed at load, and the scale tracks the machine and the engine's overhead."""

    def __init__(self, decay: float = 0.98) -> None:
        self.decay = decay
        self.n = self.sx = self.sy = self.sxx = self.sxy = 0.0
        self.count = 0
        self.shape: tuple[float, float] | None = None
        self._observed = self._predicted = 0.0

    def set_shape(self, points: Sequence[tuple[float, float]]) -> None:
        """The line through `points` (plain least squares) as the cost's shape."""
        fit = LinearCost(decay=1.0)
        for x, y in points:
            fit.observe(x, y)
        self.shape = fit.coefficients()
        self._observed = self._predicted = 0.0

    def observe(self, x: float, y: float) -> None:
        d = self.decay
        self.n = d * self.n + 1.0
        self.sx = d * self.sx + x
        self.sy = d * self.sy + y
        self.sxx = d * self.sxx + x * x
        self.sxy = d * self.sxy + x * y
        self.count += 1
        if self.shape is not None:
            a0, b0 = self.shape
            self._observed = d * self._observed + y
            self._predicted = d * self._predicted + a0 + b0 * x

    def fade(self, factor: float) -> None:
        """Scales what the line predicts by `factor`, as if every sample's `y` had been, keeping the
        samples' weight: a cost learned only from some steps fades toward 0 while none run, and the
        next samples pull it back at the usual rate."""
        self.sy *= factor
        self.sxy *= factor
        self._observed *= factor

    @property
    def scale(self) -> float:
        """Recent costs over the measured shape's (1.0 without a shape or samples)."""
        if self.shape is None or self._predicted <= 0:
            return 1.0
        return self._observed / self._predicted

    def coefficients(self) -> tuple[float, float]:
        if self.shape is not None:
            a0, b0 = self.shape
            return self.scale * a0, self.scale * b0
        if self.n == 0:
            return 0.0, 0.0
        mx, my = self.sx / self.n, self.sy / self.n
        var = self.sxx / self.n - mx * mx
        if var <= 1e-9 * max(1.0, mx * mx):
            # No spread in x yet: attribute everything to the fixed cost (optimistic for speculation).
            return my, 0.0
        b = max(0.0, (self.sxy / self.n - mx * my) / var)
        a = max(0.0, my - b * mx)
        return a, b

    def predict(self, x: float) -> float:
        a, b = self.coefficients()
        return a + b * x
