"""This rank's gradient shards against their own history: the suspicion tier's local statistics.

Each step, per tensor, the log mean square of the gradient shard this rank holds (without the loss
scale), its `level`. Each rank keeps the levels of its last `window` accepted steps on the device
(`ShardHistory`, its own state: a checkpoint writes one file per rank). A shard's `rise` is its
level minus the median of its history: how far it moved from where it was. Two numbers per tensor
leave the rank, through the monitor's MAX all-reduce (with the rise's negation, so that the
smallest rise comes along):

    rise   the shard's rise; over the ranks holding the tensor, the largest and the smallest
    alone  the rise minus the median rise of all this rank's shards: how far the shard rose
           beyond the rest of this rank's gradient (the learning rate, the loss, a warm-up move
           every tensor of the rank together)

Silent data corruption raises one shard of one tensor: its rise leaves the other ranks' rises of
the same tensor behind, and this rank's other tensors too. A head or a layer waking up moves its
tensors together on one rank, and the whole model moves together on every rank; each shows in
one number only (resilience/suspect.py watches both). No host synchronization: the history, the
medians and the packing stay on the device.
"""

from __future__ import annotations

from typing import Any

import torch

EMPTY = -1e30
"""A shard statistic no rank has: neutral in a MAX all-reduce."""


def shard_levels(sum_sq: torch.Tensor, sizes: torch.Tensor, grad_factor: float) -> torch.Tensor:
    """Per tensor the log mean square of this rank's shard without the loss scale; NaN for a
    shard this rank does not hold or a non-finite one (the non-finite check has those)."""
    mean_sq = sum_sq.float() / sizes.clamp_min(1) / grad_factor**2
    logs = mean_sq.clamp_min(1e-38).log()
    return logs.where((sizes > 0) & logs.isfinite(), torch.nan)


def lower_median(values: torch.Tensor, dim: int) -> torch.Tensor:
    """The median ignoring NaN, the lower middle value for an even count (torch's rule; the
    bench's NumPy mirror takes the same); NaN where all are NaN."""
    return values.nanmedian(dim=dim).values


def shard_statistics(levels: torch.Tensor, center: torch.Tensor) -> torch.Tensor:
    """[rise, -rise, alone] of this rank's shards (`center`: the median of each shard's history,
    NaN where there is none), EMPTY where a value is unknown: ready for a MAX all-reduce."""
    rise = levels - center
    alone = rise - lower_median(rise, 0)
    packed = torch.cat([rise, -rise, alone])
    return packed.nan_to_num(nan=EMPTY)


class ShardHistory:
    """The levels of this rank's shards at its last `window` accepted steps, on the device."""

    def __init__(self, window: int, num_tensors: int, device: torch.device) -> None:
        self.window, self.device = window, device
        self.values = torch.full((window, num_tensors), torch.nan, device=device)
        self.count = 0  # levels added so far (the ring's next row is count % window)
        self.center_cache: torch.Tensor | None = None

    def center(self) -> torch.Tensor:
        """Per tensor the median level of the history (NaN before the first accepted step)."""
        if self.center_cache is None:
            self.center_cache = lower_median(self.values, 0)
        return self.center_cache

    def add(self, levels: torch.Tensor) -> None:
        """An accepted step's levels join the history (a device copy, no synchronization)."""
        self.values[self.count % self.window].copy_(levels)
        self.count += 1
        self.center_cache = None

    def state_dict(self) -> dict[str, Any]:
        """A host copy, as the backend's state is: rollback snapshots and a joining fault-tolerant
        group's transfer hold it, a checkpoint writes it to this rank's own file. Taken only
        where those copy the weights to the host anyway (never on a plain step)."""
        return {"levels": self.values.to("cpu", copy=True), "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A saved history of the same tensors and window; anything else (another world size or
        model, an earlier bigtrain: {}) starts the history empty, as at a run's start."""
        levels = state.get("levels")
        self.center_cache = None
        if isinstance(levels, torch.Tensor) and levels.shape == self.values.shape:
            self.values.copy_(levels)
            self.count = int(state["count"])
        else:
            self.values.fill_(torch.nan)
            self.count = 0
