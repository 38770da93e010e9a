"""Spike detectors over a rolling window: mean + k sigma, or the robust median + k MAD.

Fed the same reduced numbers on every rank, they reach the same decision on every rank. A value is
a spike when it exceeds the baseline of the previous `window` healthy values by `k` spreads, once
`warmup` values have been seen, and (for magnitudes) is at least `min_factor` times the baseline
and times the median of the last `RECENT` values.
Before that, from `WARMUP_MIN_VALUES` values on, a value at least `warmup_factor` times the median
of those seen is a spike: early training swings too widely for k sigma, but not by 20x.
`check` does not change the window; the monitor `add`s a step's
values only when the step was healthy, so spikes never become "normal".

One detector watches a vector of series at once (one per gradient tensor), with the same rule per
column; a scalar metric is a vector of one.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution x 1.4826 = its standard deviation
WARMUP_MIN_VALUES = 5
RECENT = 5  # the last healthy values a spike must also exceed by min_factor
METHODS = ("mean_std", "median_mad")


@dataclass(frozen=True)
class Spike:
    metric: str
    value: float
    threshold: float
    baseline: float
    tensor: str | None = None

    @property
    def ratio(self) -> float:
        """How far above its baseline the value is (inf for a zero baseline or a non-finite value)."""
        return self.value / self.baseline if self.baseline > 0 else float("inf")


class SpikeDetector:
    def __init__(
        self,
        metric: str,
        names: list[str] | None = None,
        window: int = 100,
        k: float = 3.0,
        method: str = "mean_std",
        warmup: int = 20,
        min_factor: float = 1.0,
        warmup_factor: float = 20.0,
        relative_floor: float = 0.0,
    ) -> None:
        """relative_floor: columns below this fraction of the step's largest value never spike
        (per-tensor max |g|: a tensor whose gradient is rounding noise, like attention's key
        bias, whose exact gradient is zero, swings by orders of magnitude without meaning)."""
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        if warmup > window:
            raise ValueError(f"warmup ({warmup}) cannot exceed the window ({window})")
        self.metric, self.names, self.k, self.method, self.warmup = metric, names, k, method, warmup
        self.min_factor, self.warmup_factor = min_factor, warmup_factor
        self.relative_floor = relative_floor
        self.values: deque[np.ndarray] = deque(maxlen=window)

    def bounds(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(baseline, threshold) per column; None before WARMUP_MIN_VALUES values."""
        if not self.values or len(self.values) < min(self.warmup, WARMUP_MIN_VALUES):
            return None
        data = np.stack(self.values).astype(np.float64)  # [window, columns]
        if len(self.values) < self.warmup:  # warm-up: only far-off values (a column at 0: none)
            baseline = np.median(data, axis=0)
            return baseline, np.where(baseline > 0, self.warmup_factor * baseline, np.inf)
        if self.method == "mean_std":
            baseline, spread = data.mean(axis=0), data.std(axis=0)
        else:
            baseline = np.median(data, axis=0)
            spread = MAD_TO_SIGMA * np.median(np.abs(data - baseline), axis=0)
        # A floor on the spread: a perfectly flat history would call any wiggle a spike.
        spread = np.maximum(spread, np.maximum(1e-3 * np.abs(baseline), 1e-12))
        return baseline, baseline + self.k * spread

    def check(self, value: float | list[float] | np.ndarray) -> list[Spike]:
        """The spikes among the columns of `value`, largest ratio first; the window is unchanged.
        Non-finite values are left to the non-finite check."""
        x = np.atleast_1d(np.asarray(value, dtype=np.float64))
        found = self.bounds()
        if found is None:
            return []
        baseline, threshold = found
        # The factor counts against the recent values too: a series that grows over training (a
        # layer's max |g| often does) drifts past its long-window mean without any spike.
        recent = np.median(np.stack(list(self.values)[-RECENT:]), axis=0)
        floor = self.min_factor * np.maximum(baseline, recent)
        finite = x[np.isfinite(x)]
        if self.relative_floor > 0 and finite.size:
            floor = np.maximum(floor, self.relative_floor * finite.max())
        spikes = [
            Spike(
                self.metric,
                float(x[i]),
                float(threshold[i]),
                float(baseline[i]),
                self.names[i] if self.names else None,
            )
            for i in np.flatnonzero(np.isfinite(x) & (x > threshold) & (x >= floor))
        ]
        return sorted(spikes, key=lambda s: -s.ratio)

    def add(self, value: float | list[float] | np.ndarray) -> None:
        x = np.atleast_1d(np.asarray(value, dtype=np.float64))
        if np.isfinite(x).all():
            self.values.append(x)

    def update(self, value: float) -> Spike | None:
        """Scalar convenience: check, and add the value when it is not a spike."""
        if not math.isfinite(value):
            return Spike(self.metric, value, float("nan"), float("nan"))
        spikes = self.check(value)
        if not spikes:
            self.add(value)
        return spikes[0] if spikes else None

    def state_dict(self) -> dict[str, Any]:
        return {"values": [v.tolist() for v in self.values]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.values.clear()
        for v in state["values"]:
            self.values.append(np.asarray(v, dtype=np.float64))
