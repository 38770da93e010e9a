"""Spike detectors over a rolling window: mean + k sigma, or the robust median + k MAD.

Fed the same reduced numbers on every rank, they reach the same decision on every rank. A value is
a spike when it exceeds the baseline of the previous `window` healthy values by `k` spreads, once
`warmup` values have been seen; spikes are not added to the window (they are not "normal").
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution x 1.4826 = its standard deviation


@dataclass(frozen=True)
class Spike:
    metric: str
    value: float
    threshold: float
    baseline: float


class SpikeDetector:
    def __init__(
        self,
        metric: str,
        window: int = 100,
        k: float = 3.0,
        method: str = "mean_std",
        warmup: int = 20,
    ) -> None:
        if method not in ("mean_std", "median_mad"):
            raise ValueError(f"method must be 'mean_std' or 'median_mad', got {method!r}")
        self.metric, self.k, self.method, self.warmup = metric, k, method, warmup
        self.values: deque[float] = deque(maxlen=window)

    def threshold(self) -> tuple[float, float] | None:
        """(baseline, threshold), or None during warm-up."""
        if len(self.values) < self.warmup:
            return None
        data = np.asarray(self.values, dtype=np.float64)
        if self.method == "mean_std":
            baseline, spread = float(data.mean()), float(data.std())
        else:
            baseline = float(np.median(data))
            spread = MAD_TO_SIGMA * float(np.median(np.abs(data - baseline)))
        # A floor on the spread: a perfectly flat history would call any wiggle a spike.
        spread = max(spread, 1e-3 * abs(baseline), 1e-12)
        return baseline, baseline + self.k * spread

    def update(self, value: float) -> Spike | None:
        """The spike this value is, if it is one; otherwise it joins the window."""
        if not math.isfinite(value):
            return Spike(self.metric, value, float("nan"), float("nan"))
        bounds = self.threshold()
        if bounds is not None and value > bounds[1]:
            return Spike(self.metric, value, bounds[1], bounds[0])
        self.values.append(value)
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"values": list(self.values)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.values.clear()
        self.values.extend(state["values"])
