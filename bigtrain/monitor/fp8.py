"""The FP8 layers' statistics, carried by the monitor's MAX all-reduce (docs/fp8.md).

Each FP8 layer folds its forwards' statistics into a small buffer (precision/fp8.py: `STATS`).
`Fp8Stats.take` lays every FP8 layer of the whole model out in one vector, the same layout on
every rank (zeros for the layers this rank does not hold: pipeline stages), which rides along
the monitor's MAX all-reduce over the ranks and, with replica groups, over the live groups inside
the step, before any group commits: every rank of every group then holds the same numbers and
callbacks/fp8_health.py takes the same decisions everywhere. No collective and no host read of
its own: they come with the monitor's.

`read` keeps the reduced rows of the step's runs (its first run and a replay of it) as their
maximum, for the callback to judge after the healer's decision.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from bigtrain.monitor.slots import HostValues, Slot
from bigtrain.precision.fp8 import STATS
from bigtrain.utils.tensors import local_tensor

FP8 = "fp8_stats"
"""The slot of `Fp8Stats.take`: one row of STATS per FP8 layer, maxed over ranks and groups."""


class Fp8Stats:
    def __init__(self, layers: dict[str, nn.Module]) -> None:
        """`layers`: the FP8 layers by canonical name, every one the build made (the vector's
        layout). The callback replaces the modules in place with those the backend runs."""
        self.layers = layers
        self.names = list(layers)
        self.rows: list[list[float]] | None = None  # the step's reduced rows, max over its runs

    def slots(self) -> list[Slot]:
        return [Slot(FP8, len(self.names) * len(STATS), "max")]

    def take(self, device: torch.device) -> dict[str, torch.Tensor]:
        """This rank's rows (zeros for another stage's layers); NaN sent as +inf, which a MAX
        all-reduce keeps on every backend."""
        zeros = torch.zeros(len(STATS), device=device)
        rows = [
            local_tensor(self.layers[n].fp8_stats).float().to(device) if n in self.layers else zeros
            for n in self.names
        ]
        stacked = torch.stack(rows)
        return {FP8: torch.where(stacked.isnan(), float("inf"), stacked)}

    def read(self, host: HostValues) -> dict[str, Any]:
        """Keep the reduced rows (the larger of this run's and an earlier run's of the step)."""
        flat, width = host[FP8], len(STATS)
        rows = [flat[i * width : (i + 1) * width] for i in range(len(self.names))]
        if self.rows is not None:
            rows = [
                [max(a, b) for a, b in zip(old, new, strict=True)]  # no NaN: `take` sent +inf
                for old, new in zip(self.rows, rows, strict=True)
            ]
        self.rows = rows
        return {}

    def clear(self) -> None:
        """A new step (not a replay of this one) starts."""
        self.rows = None
