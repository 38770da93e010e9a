"""Gradient clipping threshold: fixed (optim.grad_clip), or adaptive (a running percentile of
recent healthy gradient norms, for very large models whose norm drifts over training)."""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np


class ClipThreshold:
    def __init__(self, fixed: float, adaptive: bool, percentile: float, window: int) -> None:
        self.fixed, self.adaptive, self.percentile = fixed, adaptive, percentile
        self.history: deque[float] = deque(maxlen=window)
        self.min_history = max(10, window // 10)  # use the fixed value until enough was seen

    def value(self) -> float:
        if not self.adaptive or len(self.history) < self.min_history:
            return self.fixed
        return float(np.percentile(np.asarray(self.history), self.percentile))

    def record(self, healthy_norm: float) -> None:
        if self.adaptive:
            self.history.append(healthy_norm)

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history.clear()
        self.history.extend(state["history"])
