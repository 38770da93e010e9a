"""This rank's gradient shards against their own history: the suspicion tier's local statistics.

Each step, per tensor, the log mean square of the gradient shard this rank holds (without the loss
scale), its `level`. Each rank keeps the levels of its last `window` accepted steps on the device
(`ShardHistory`, its own state: a checkpoint writes one file per rank). A shard's `rise` is its
level minus the median of its history: how far it moved from where it was. Three numbers per
tensor leave the rank, through the monitor's MAX all-reduce (with the rise's negation, so that the
smallest rise comes along):

    rise   the shard's rise; over the ranks holding the tensor, the largest and the smallest
    alone  the rise minus the median rise of all this rank's shards: how far the shard rose
           beyond the rest of this rank's gradient (the learning rate, the loss, a warm-up move
           every tensor of the rank together)
    pair   the rise of the shard's level minus its partner's: the partner is the shard, among the
           `neighbours` registered just before and after it (its layer's others), whose level
           difference with it varied least over the history (q with k, a weight with its bias);
           the alone value until the history holds PAIR_MIN_VALUES steps

Silent data corruption raises one shard of one tensor: its rise leaves the other ranks' rises of
the same tensor behind, its rank's other tensors and its partner too. A head or a layer waking up
moves its tensors together on one rank, and the whole model moves together on every rank; each
shows in some numbers only (resilience/suspicion.py watches all three). No host synchronization:
the history, the medians, the partners and the packing stay on the device.
"""

from __future__ import annotations

from typing import Any

import torch

from bigtrain.monitor.slots import Slot

SHARDS = "shards"
"""The slot of the shard statistics (`shard_slot`)."""
EMPTY = -1e30
"""A shard statistic no rank has: neutral in a MAX all-reduce."""
PAIR_MIN_VALUES = 3
"""Accepted steps in the history before partners are chosen (a spread of fewer means nothing)."""


def shard_levels(sum_sq: torch.Tensor, sizes: torch.Tensor, grad_factor: float) -> torch.Tensor:
    """Per tensor the log mean square of this rank's shard without the loss scale; NaN for a
    shard this rank does not hold or a non-finite one (the non-finite check has those)."""
    mean_sq = sum_sq.float() / sizes.clamp_min(1) / grad_factor**2
    logs = mean_sq.clamp_min(1e-38).log()
    return logs.where((sizes > 0) & logs.isfinite(), torch.nan)


def shard_slot(num_tensors: int) -> Slot:
    """[rise, -rise, alone, pair] per tensor (`shard_statistics`), maxed over the ranks."""
    return Slot(SHARDS, 4 * num_tensors, "max")


def lower_median(values: torch.Tensor, dim: int) -> torch.Tensor:
    """The median ignoring NaN, the lower middle value for an even count (torch's rule; the
    bench's NumPy mirror takes the same); NaN where all are NaN."""
    return values.nanmedian(dim=dim).values


def shard_statistics(
    levels: torch.Tensor, center: torch.Tensor, pair: torch.Tensor
) -> torch.Tensor:
    """[rise, -rise, alone, pair] of this rank's shards (`center`: the median of each shard's
    history, NaN where there is none; `pair`: its level's rise over its partner's, NaN where it has
    none: the alone value stands in), EMPTY where a value is unknown: ready for a MAX all-reduce."""
    rise = levels - center
    alone = rise - lower_median(rise, 0)
    packed = torch.cat([rise, -rise, alone, pair.where(pair.isfinite(), alone)])
    return packed.nan_to_num(nan=EMPTY)


def neighbour_columns(
    num: int, neighbours: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """[offset, tensor] the columns of each tensor's `neighbours` before and after it (nearest
    first, before then after; clamped) and whether each lies inside the table. Made once: a
    host-to-device copy each step would be a host synchronization."""
    offsets = [o for d in range(1, neighbours + 1) for o in (-d, d)]
    columns = torch.arange(num)[None] + torch.tensor(offsets)[:, None]
    inside = (columns >= 0) & (columns < num)
    return columns.clamp(0, max(num - 1, 0)).to(device), inside.to(device)


def partners(
    values: torch.Tensor, columns: torch.Tensor, inside: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per tensor (column of `values`, a history of levels, NaN rows unfilled) the neighbour
    (`neighbour_columns`) whose level difference with it has the least median absolute
    deviation, and that difference's median; -1 and NaN where none has one. Ties go to the
    first neighbour."""
    diff = values[:, None, :] - values[:, columns]  # [step, offset, tensor]
    center = lower_median(diff, 0)
    spread = lower_median((diff - center).abs(), 0)
    spread = spread.where(inside & spread.isfinite(), torch.inf)
    best = spread.argmin(dim=0, keepdim=True)
    found = spread.gather(0, best)[0].isfinite()
    partner = columns.gather(0, best)[0].where(found, -1)
    return partner, center.gather(0, best)[0].where(found, torch.nan)


class ShardHistory:
    """The levels of this rank's shards at its last `window` accepted steps, on the device, and
    what each step is measured against: their medians and each shard's partner (module
    docstring), worked out once per accepted step."""

    def __init__(
        self, window: int, num_tensors: int, device: torch.device, neighbours: int = 4
    ) -> None:
        self.window, self.device = window, device
        self.values = torch.full((window, num_tensors), torch.nan, device=device)
        self.columns, self.inside = neighbour_columns(num_tensors, neighbours, device)
        self.count = 0  # levels added so far (the ring's next row is count % window)
        self.center_cache: torch.Tensor | None = None
        self.partner_cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def center(self) -> torch.Tensor:
        """Per tensor the median level of the history (NaN before the first accepted step)."""
        if self.center_cache is None:
            self.center_cache = lower_median(self.values, 0)
        return self.center_cache

    def partners(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per tensor its partner's index (-1: none yet) and the median of their level
        difference (`partners`); none before PAIR_MIN_VALUES accepted steps."""
        if self.partner_cache is None:
            if self.count < PAIR_MIN_VALUES:
                none = torch.full((self.values.shape[1],), -1, device=self.device)
                self.partner_cache = none, torch.full_like(self.values[0], torch.nan)
            else:
                self.partner_cache = partners(self.values, self.columns, self.inside)
        return self.partner_cache

    def statistics(self, levels: torch.Tensor) -> torch.Tensor:
        """This step's [rise, -rise, alone, pair] (`shard_statistics`) against the history."""
        partner, pair_center = self.partners()
        pair = levels - levels[partner.clamp_min(0)] - pair_center  # NaN where no partner
        return shard_statistics(levels, self.center(), pair)

    def add(self, levels: torch.Tensor) -> None:
        """An accepted step's levels join the history (a device copy, no synchronization)."""
        self.values[self.count % self.window].copy_(levels)
        self.count += 1
        self.center_cache = self.partner_cache = None

    def state_dict(self) -> dict[str, Any]:
        """A host copy, as the backend's state is: rollback snapshots and a joining fault-tolerant
        group's transfer hold it, a checkpoint writes it to this rank's own file. Taken only
        where those copy the weights to the host anyway (never on a plain step)."""
        return {"levels": self.values.to("cpu", copy=True), "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A saved history of the same tensors and window; anything else (another world size or
        model, an earlier bigtrain: {}) starts the history empty, as at a run's start."""
        levels = state.get("levels")
        self.center_cache = self.partner_cache = None
        if isinstance(levels, torch.Tensor) and levels.shape == self.values.shape:
            self.values.copy_(levels)
            self.count = int(state["count"])
        else:
            self.values.fill_(torch.nan)
            self.count = 0
