"""The suspicion tier: a gradient shard that jumped, replayed before anything acts on it.

Silent data corruption (a flipped bit, a bad matmul on one device) shows as one rank's shard of
one gradient tensor far from where it was and from the other ranks' shards; so do a few healthy
steps (a head waking up), which is why a suspicion only replays the step (replay.py): corruption
does not come back, the data's own spikes do. Nothing is skipped and no LR is cut.

Per tensor the monitor reduces (MAX over ranks, identical on every rank) the largest log mean
square of a rank's shard and the negated smallest (monitor.py: `Health.shards`). A tensor whose
shards two or more ranks hold is watched by its split, the largest minus the smallest: ranks that
hold parts of one tensor see its gradient the same way step after step, so a split that jumps
means one shard moved alone. A tensor one rank holds whole (one process, DDP, a small tensor)
is watched by its level, the largest shard against its own history. A value is suspicious when
it is above the median of its last `window` healthy values by 2 log(factor) (the factor applies
to norms, the values are log squares) and, once `min_values` are known, by `sigmas` robust
standard deviations. The settings and their measured suspicions per 1,000 healthy steps and
catch rates are in docs/healing.md (bench/detection.py).
"""

from __future__ import annotations

import math
import warnings
from collections import deque
from typing import Any

import numpy as np

from bigtrain.config.resilience import SuspicionConfig
from bigtrain.monitor.monitor import EMPTY
from bigtrain.resilience.rules import MAD_TO_SIGMA


def series(shards: list[float]) -> np.ndarray:
    """Per tensor the watched value: the split where two or more ranks hold shards, else the
    level (NaN: no rank holds it)."""
    both = np.asarray(shards, dtype=np.float64).reshape(2, -1)
    high, low = both[0], -both[1]
    held = both[0] > EMPTY / 2
    split = np.where(high > low, high - low, np.nan)  # equal: one holder (or equal shards)
    return np.where(held, np.where(np.isnan(split), high, split), np.nan)


class Suspicion:
    def __init__(self, cfg: SuspicionConfig, names: list[str]) -> None:
        self.cfg, self.names = cfg, names
        self.values: deque[np.ndarray] = deque(maxlen=cfg.window)
        self.margin = 2 * math.log(cfg.factor)
        self.limits: tuple[np.ndarray, np.ndarray] | None = None  # until the next add

    def baseline(self) -> tuple[np.ndarray, np.ndarray]:
        """Per tensor the median of its history and the margin above it (NaN: no history)."""
        if self.limits is None:
            history = np.stack(self.values)
            with np.errstate(invalid="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN: a tensor no one holds
                center = np.nanmedian(history, axis=0)
                margin = np.full_like(center, self.margin)
                if len(history) >= self.cfg.min_values:
                    spread = MAD_TO_SIGMA * np.nanmedian(np.abs(history - center), axis=0)
                    margin = np.maximum(margin, self.cfg.sigmas * spread)
            self.limits = center, margin
        return self.limits

    def check(self, shards: list[float] | None) -> list[list]:
        """[name, jump over its baseline as a norm ratio] of the suspicious tensors, largest
        first; [] before any history."""
        if shards is None or not self.values or not self.cfg.enabled:
            return []
        center, margin = self.baseline()
        jump = series(shards) - center
        with np.errstate(invalid="ignore"):
            hit = np.flatnonzero(np.nan_to_num(jump - margin, nan=-1.0) > 0)
        order = hit[np.argsort(-jump[hit], kind="stable")]
        return [[self.names[i], float(math.exp(jump[i] / 2))] for i in order]

    def add(self, shards: list[float] | None) -> None:
        """A healthy step's values join the history."""
        if shards is not None:
            self.values.append(series(shards))
            self.limits = None

    def state_dict(self) -> dict[str, Any]:
        return {"values": [np.nan_to_num(v, nan=EMPTY).tolist() for v in self.values]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.values.clear()
        self.limits = None
        for v in state.get("values", []):
            if len(v) == len(self.names):
                row = np.asarray(v, dtype=np.float64)
                self.values.append(np.where(row <= EMPTY / 2, np.nan, row))
