"""Per-tensor gradient statistics and their reduction over ranks (torch path).

For each gradient tensor (or local shard): max |g|, the sum of squares (accumulated in FP32) and
the count of non-finite values. Two vectorised passes over the gradients (`_foreach_norm` with ord
inf and 2); the non-finite count runs only where a sum of squares came out non-finite, which is
exactly when a tensor holds a NaN or an Inf. Stats of shards of one tensor combine by max (max |g|)
and by sum (sum of squares, non-finite count), so one MAX and one SUM all-reduce give every rank the
statistics of the full tensors, sharded or not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class GradStats:
    """Per-tensor statistics, index-aligned with `names`. Tensors on the gradients' device."""

    names: list[str]
    max_abs: torch.Tensor  # float32 [n]
    sum_sq: torch.Tensor  # float32 [n]
    nonfinite: torch.Tensor  # float32 [n] (a count; float so it packs with the sums)

    @property
    def global_norm(self) -> torch.Tensor:
        return self.sum_sq.sum().sqrt()


def local_grad_stats(
    named_grads: list[tuple[str, torch.Tensor]], device: torch.device
) -> GradStats:
    names = [n for n, _ in named_grads]
    grads = [g for _, g in named_grads if g.numel()]
    nonempty = torch.tensor([g.numel() > 0 for _, g in named_grads], device=device)
    max_abs = torch.zeros(len(names), dtype=torch.float32, device=device)
    sum_sq = torch.zeros(len(names), dtype=torch.float32, device=device)
    nonfinite = torch.zeros(len(names), dtype=torch.float32, device=device)
    if grads:
        maxes = torch.stack([m.float() for m in torch._foreach_norm(grads, float("inf"))])
        norms = torch.stack([n.float() for n in torch._foreach_norm([g.float() for g in grads], 2)])
        max_abs[nonempty] = maxes
        sum_sq[nonempty] = norms.square()
        # Expensive device-to-host synchronization only on the slow path: some tensor is non-finite.
        bad = ~torch.isfinite(sum_sq)
        if bool(bad.any()):
            for i in bad.nonzero().flatten().tolist():
                nonfinite[i] = (~torch.isfinite(named_grads[i][1])).sum().float()
    return GradStats(names, max_abs, sum_sq, nonfinite)


def reduce_grad_stats(stats: GradStats, local_loss: torch.Tensor) -> tuple[GradStats, torch.Tensor]:
    """Combine shards over ranks: one MAX all-reduce (max |g|) and one SUM all-reduce (sums of
    squares, non-finite counts and the loss, packed into one vector). Returns the reduced stats and
    the mean loss over ranks; identical on every rank."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return stats, local_loss.float()
    n = len(stats.names)
    # NaN does not survive a MAX all-reduce reliably; max |g| of a non-finite tensor is reported as inf.
    max_abs = torch.where(
        torch.isnan(stats.max_abs), torch.full_like(stats.max_abs, float("inf")), stats.max_abs
    )
    dist.all_reduce(max_abs, op=dist.ReduceOp.MAX)
    packed = torch.cat([stats.sum_sq, stats.nonfinite, local_loss.float().reshape(1)])
    dist.all_reduce(packed, op=dist.ReduceOp.SUM)
    world = dist.get_world_size()
    reduced = GradStats(stats.names, max_abs, packed[:n], packed[n : 2 * n])
    return reduced, packed[2 * n] / world


def top_tensors(stats: GradStats, k: int = 5) -> dict[str, list[tuple[str, float]]]:
    """The k tensors with the largest max |g| and with the most non-finite values (host values)."""
    # Expensive device-to-host synchronization: for anomaly reports only.
    max_abs, nonfinite = stats.max_abs.tolist(), stats.nonfinite.tolist()
    by_max = sorted(
        zip(stats.names, max_abs, strict=True),
        key=lambda x: -x[1] if x[1] == x[1] else float("-inf"),
    )
    by_bad = sorted(
        ((n, c) for n, c in zip(stats.names, nonfinite, strict=True) if c > 0), key=lambda x: -x[1]
    )
    return {"max_abs": by_max[:k], "nonfinite": by_bad[:k]}
