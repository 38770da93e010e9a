"""The suspicion tier: a gradient shard that rose alone, replayed before anything acts on it.

Silent data corruption (a flipped bit, a bad matmul on one device) raises one rank's shard of one
gradient tensor; so do a few healthy steps (a head waking up), which is why a suspicion only
replays the step (replay.py): corruption does not come back, the data's own spikes do. Nothing is
skipped and no LR is cut.

Each rank measures its shards against their own history (monitor/shards.py: a shard's rise over
the median of its last `window` levels, beyond its rank's median rise, beyond its partner's) and
the monitor's MAX all-reduce gives every rank, per tensor, the largest and the smallest rise over
the ranks that hold it, the largest rise alone and the largest rise over a partner. Three series
per tensor follow, identical on every rank:

    split  the largest rise minus the smallest where two or more ranks hold the tensor: the ranks
           see one tensor's gradient move the same way, step after step, so a split means one
           shard moved alone; a tensor one rank holds whole (one process, DDP, a small tensor):
           its rise
    alone  the largest rise beyond the rank's median: one shard moved, not its rank's gradient
    pair   the largest rise beyond the shard's partner (the neighbour that moved most like it)

A tensor is suspicious when all three are above the median of their last `window` values by
2 log(factor) (the factors apply to norms, the values are log squares: `factor`, `alone_factor`,
`pair_factor`), by the largest rise over that median the window holds (`excursion` times: the
tensor's own recent healthy excursions) and, once `min_values` are known, by `sigmas`
(`alone_sigmas`, `pair_sigmas`) robust standard deviations (a lone holder's split, its own rise,
by `lone_share` of the excursion's and the sigmas' margins: that history holds every move of the
rank's gradient, which the alone series takes out); and when it rose alone in the step:
its jump as a share of its margins (the lesser of split's and alone's) exceeds `lead` times any
other tensor's that reached `rival_share` of its own margins (a volatile tensor's moves, however
large, count for what they are to that tensor: its ordinary noise hides nothing). Each series
alone mistakes healthy moves for corruption: a head that wakes up rises alone across ranks but
with its layer on its rank, and with its partner (q with k); the other rank's head falling
silent makes a split without any rise beyond the rank; a loss spike or a layer waking in warm-up
moves several tensors at once, most of them far. The measured suspicions per 1,000 healthy
steps and catch rates are in docs/healing.md (bench/detection.py).
"""

from __future__ import annotations

import math
import warnings
from collections import deque
from typing import Any

import numpy as np

from bigtrain.config.resilience import SuspicionConfig
from bigtrain.model.gpt import GradientRoles
from bigtrain.monitor.shards import EMPTY
from bigtrain.resilience.rules import MAD_TO_SIGMA

SERIES = 3  # split, alone, pair


def series(shards: list[float], unlike: np.ndarray | None = None) -> np.ndarray:
    """[split, alone, pair] per tensor (module docstring) from the reduced shard statistics; NaN
    where unknown (no rank holds the tensor, or no history yet). `unlike` tensors (rows that need
    not move together) have their largest rise as their split."""
    rows = np.asarray(shards, dtype=np.float64).reshape(SERIES + 1, -1)
    high, low, alone, pair = rows[0], -rows[1], rows[2], rows[3]
    known = rows[0] > EMPTY / 2
    split = np.where(high > low, high - low, high)  # equal: one holder (or equal rises)
    if unlike is not None:
        split = np.where(unlike, high, split)
    return np.stack(
        [
            np.where(known, split, np.nan),
            np.where(alone > EMPTY / 2, alone, np.nan),
            np.where(pair > EMPTY / 2, pair, np.nan),
        ]
    )


def lone_holders(shards: list[float]) -> np.ndarray:
    """Per tensor whether its largest and smallest rise are one: one rank holds it whole (or the
    ranks' rises are equal), so its split is its rise (`series`)."""
    rows = np.asarray(shards, dtype=np.float64).reshape(SERIES + 1, -1)
    return ~(rows[0] > -rows[1])


class Suspicion:
    def __init__(
        self, cfg: SuspicionConfig, names: list[str], roles: GradientRoles = GradientRoles()
    ) -> None:
        """`roles` (model/gpt.py `gradient_roles`): an inert tensor's rounding noise is never
        suspected nor held against another tensor's lead (a corruption of it changes nothing the
        model computes); an unlike tensor's split is its largest rise, as a lone holder's."""
        self.cfg, self.names = cfg, names
        self.watched = np.array([n not in roles.inert for n in names], dtype=bool)
        self.unlike = np.array([n in roles.unlike for n in names], dtype=bool)
        self.values: deque[np.ndarray] = deque(maxlen=cfg.window)
        self.factors = 2 * np.log([[cfg.factor], [cfg.alone_factor], [cfg.pair_factor]])
        self.sigmas = np.array([[cfg.sigmas], [cfg.alone_sigmas], [cfg.pair_sigmas]])
        self.limits: tuple[np.ndarray, np.ndarray] | None = None  # until the next add

    def baseline(self) -> tuple[np.ndarray, np.ndarray]:
        """Per series and tensor the median of its history and the margin above it (NaN: no
        history): the factor, the largest excursion over the median the window holds and, from
        `min_values` values on, the sigmas."""
        if self.limits is None:
            history = np.stack(self.values)
            with np.errstate(invalid="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN: a tensor no one holds
                center = np.nanmedian(history, axis=0)
                excursion = self.cfg.excursion * np.nanmax(history - center, axis=0)
                margin = np.fmax(self.factors, excursion)
                if len(history) >= self.cfg.min_values:
                    spread = MAD_TO_SIGMA * np.nanmedian(np.abs(history - center), axis=0)
                    margin = np.fmax(margin, self.sigmas * spread)
            self.limits = center, margin
        return self.limits

    def check(self, shards: list[float] | None) -> list[list]:
        """[name, split's jump over its baseline as a norm ratio] of the suspicious tensors,
        largest first; [] before any history."""
        if shards is None or not self.values or not self.cfg.enabled:
            return []
        center, margin = self.baseline()
        jump = series(shards, self.unlike) - center
        needed = margin.copy()  # a lone holder's rise: a share of its history's margins
        shared = np.fmax(self.factors[0], self.cfg.lone_share * margin[0])
        needed[0] = np.where(lone_holders(shards), shared, margin[0])
        with np.errstate(invalid="ignore"):
            above = (np.nan_to_num(jump - needed, nan=-1.0) > 0).all(axis=0)
            reach = np.nan_to_num((jump[:2] / margin[:2]).min(axis=0), nan=-np.inf)
        moved = np.where(self.watched, reach, -np.inf)  # split and alone, in their margins
        rivals = np.where(reach >= self.cfg.rival_share, moved, -np.inf)
        led = moved > self.cfg.lead * np.maximum(runner_up(rivals), 0.0)  # never an inert one
        company = np.where(self.watched, reach, -np.inf) >= self.cfg.company
        led &= company.sum() - company <= 0  # no other tensor left its own margins
        hit = np.flatnonzero(above & led)
        order = hit[np.argsort(-jump[0, hit], kind="stable")]
        return [[self.names[i], float(math.exp(jump[0, i] / 2))] for i in order]

    def add(self, shards: list[float] | None) -> None:
        """A healthy step's values join the history."""
        if shards is not None:
            self.values.append(series(shards, self.unlike))
            self.limits = None

    def state_dict(self) -> dict[str, Any]:
        return {"values": [np.nan_to_num(v, nan=EMPTY).ravel().tolist() for v in self.values]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A history of this model's tensors; another (an earlier bigtrain's one or two series)
        starts empty, as at a run's start."""
        self.values.clear()
        self.limits = None
        for v in state.get("values", []):
            if len(v) == SERIES * len(self.names):
                row = np.asarray(v, dtype=np.float64).reshape(SERIES, -1)
                self.values.append(np.where(row <= EMPTY / 2, np.nan, row))


def runner_up(values: np.ndarray) -> np.ndarray:
    """Per entry the largest of the others (-inf: none)."""
    if len(values) < 2:
        return np.full(len(values), -np.inf)
    top2 = np.sort(values)[-2:]
    return np.where(values >= top2[1], top2[0], top2[1])
