"""Spike rules: a step whose loss or gradient norm is far above that series' own recent history.

Fed the same reduced numbers on every rank, a rule reaches the same verdict on every rank. Its
baseline is the median of the last `window` healthy values; a value is a spike when it is at
least `factor` times the baseline and, once `min_values` values are known, also more than `sigmas`
robust standard deviations above it in log space (the MAD of the log values x 1.4826). The factor
alone decides early in training; the spread widens the threshold where a corpus makes its batches
differ more. Ratios in log space make a rule scale-free: the same settings serve a loss of 7 and
one of 2, a norm of 1e-3 and one of 10. Only healthy values enter the window (`add`), so a spike
never becomes normal.

Why these rules and not others is measured by bench/detection.py (docs/healing.md): over the
healthy sweep the loss stays within 1.07x of its recent median while the global gradient norm
jumps 50x in warm-up and single tensors' norms 1000x when attention wakes up, with no fault. So
the loss rule is sensitive (a loss spike of x10 on one rank of two is 5.5x); the gradient-norm
rule only guards against gross corruption; per-tensor statistics name the culprit
(TensorHistory) but never trigger.
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

    @property
    def ratio(self) -> float:
        """How far above its baseline the value is."""
        return self.value / self.baseline if self.baseline > 0 else math.inf


class SpikeRule:
    """One scalar series (`metric`) against its own healthy history."""

    def __init__(
        self, metric: str, window: int, factor: float, sigmas: float, min_values: int
    ) -> None:
        self.metric, self.factor, self.sigmas, self.min_values = metric, factor, sigmas, min_values
        self.values: deque[float] = deque(maxlen=window)

    def threshold(self) -> tuple[float, float] | None:
        """(baseline, threshold) from the history; None before the first value."""
        if not self.values:
            return None
        logs = np.log(np.maximum(np.asarray(self.values, dtype=np.float64), 1e-300))
        center = float(np.median(logs))
        margin = math.log(self.factor)
        if len(logs) >= self.min_values:
            spread = MAD_TO_SIGMA * float(np.median(np.abs(logs - center)))
            margin = max(margin, self.sigmas * spread)
        return math.exp(center), math.exp(center + margin)

    def check(self, value: float) -> Spike | None:
        """The spike `value` is, or None; the history is unchanged. Non-finite values are left
        to the non-finite check."""
        found = self.threshold()
        if found is None or not math.isfinite(value):
            return None
        baseline, threshold = found
        return Spike(self.metric, value, threshold, baseline) if value > threshold else None

    def add(self, value: float) -> None:
        if math.isfinite(value) and value > 0:
            self.values.append(value)

    def state_dict(self) -> dict[str, Any]:
        return {"values": list(self.values)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.values.clear()
        self.values.extend(float(v) for v in state["values"])


class TensorHistory:
    """Each gradient tensor's recent norms, to name the tensors that blew up when an anomaly is
    found (never to trigger one): per tensor, its norm over the median of its last `window`
    healthy norms. Costs one append per step; the medians are taken only on anomalies."""

    def __init__(self, names: list[str], window: int) -> None:
        self.names = names
        self.norms: deque[np.ndarray] = deque(maxlen=window)

    def add(self, sum_sq: list[float]) -> None:
        norms = np.sqrt(np.asarray(sum_sq, dtype=np.float64))
        if np.isfinite(norms).all():
            self.norms.append(norms)

    def jumps(self, sum_sq: list[float], k: int) -> list[list]:
        """The k [name, ratio] pairs with the largest norm / baseline, largest first (non-finite
        values first); [] before any history."""
        if not self.norms:
            return []
        baseline = np.median(np.stack(self.norms), axis=0)
        norms = np.sqrt(np.abs(np.asarray(sum_sq, dtype=np.float64)))
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(baseline > 0, norms / baseline, np.where(norms > 0, np.inf, 0.0))
        ratio = np.where(np.isnan(norms), np.inf, ratio)
        order = np.argsort(-ratio, kind="stable")[:k]
        return [[self.names[i], float(ratio[i])] for i in order if ratio[i] > 0]

    def state_dict(self) -> dict[str, Any]:
        return {"norms": [v.tolist() for v in self.norms]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.norms.clear()
        for v in state.get("norms", []):
            if len(v) == len(self.names):
                self.norms.append(np.asarray(v, dtype=np.float64))
