"""Per-tensor gradient statistics and their reduction over ranks.

For each gradient tensor (or this rank's shard of it): max |g|, the sum of squares (accumulated in
FP32) and the count of non-finite values. On CUDA one Triton pass (kernel.py) yields all three. The
torch fallback (CPU, or no Triton) takes `_foreach_norm` for the sums of squares every step and
`aminmax` for max |g| only on full steps (on CPU over pieces that one thread reduces); the
non-finite count runs only where a sum of squares came out non-finite, which is exactly when a
tensor holds a NaN or an Inf.

Stats of shards of one tensor combine by max (max |g|) and by sum (sum of squares, non-finite
count), so one SUM all-reduce (with the loss packed in) and, on full steps, one MAX all-reduce give
every rank the statistics of the full tensors, sharded or not, bit for bit the same on every rank.
They travel in named slots (slots.py): `grad_slots` declares them, `reduce_grad_stats` reduces a
step's pack of them and of whatever else rides along.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from bigtrain.utils.triton import triton_available

if TYPE_CHECKING:
    from bigtrain.monitor.kernel import GradStatsKernel
from bigtrain.monitor.slots import Pack, Reduction, Slot

SUM_SQ, NONFINITE, MAX_ABS, LOSS = "sum_sq", "nonfinite", "max_abs", "loss"
"""The slots of the gradient statistics and of the loss (`grad_slots`)."""


@dataclass
class GradStats:
    """Per-tensor statistics, index-aligned with `names`; float32 tensors on the gradients' device.
    `max_abs` is None on steps that computed only the cheap statistics."""

    names: list[str]
    sum_sq: torch.Tensor
    nonfinite: torch.Tensor  # a count, kept in float32 so that it packs with the sums
    max_abs: torch.Tensor | None = None

    @property
    def global_norm(self) -> torch.Tensor:
        return self.sum_sq.sum().sqrt()


# One core's L2 cache here: a full step reads each span of tensors of this size twice back to back,
# the second time (the sums of squares) from the cache.
CACHE_BYTES = 1 << 20


def full_step_spans(grads: list[torch.Tensor], device: torch.device) -> list[slice]:
    """On CPU consecutive spans of tensors of at most CACHE_BYTES (a larger tensor alone); on
    other devices one span of all of them."""
    if device.type != "cpu":
        return [slice(0, len(grads))]
    spans, start, size = [], 0, 0
    for i, g in enumerate(grads):
        nbytes = g.numel() * g.element_size()
        if size + nbytes > CACHE_BYTES and i > start:
            spans.append(slice(start, i))
            start, size = i, 0
        size += nbytes
    spans.append(slice(start, len(grads)))
    return spans


def torch_grad_stats(
    grads: list[torch.Tensor], device: torch.device, full: bool
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """The fallback: (max_abs or None, sum_sq, nonfinite) with the kernel's semantics."""
    n = len(grads)
    sum_sq = torch.zeros(n, dtype=torch.float32, device=device)
    nonfinite = torch.zeros(n, dtype=torch.float32, device=device)
    max_abs = torch.zeros(n, dtype=torch.float32, device=device) if full else None
    index = [i for i, g in enumerate(grads) if g.numel()]
    if not index:
        return max_abs, sum_sq, nonfinite
    present = [grads[i] for i in index]
    where = slice(None) if len(index) == n else torch.tensor(index, device=device)
    if full:
        norms, ends = [], []
        for span in full_step_spans(present, device):
            # aminmax reads each tensor once for both ends (no foreach op yields a min, and
            # _foreach_norm(inf) is ~5x slower on CPU) and leaves the span in the cache for the
            # sums of squares.
            ends.extend(map(torch.aminmax, present[span]))
            norms.extend(torch._foreach_norm(present[span], 2, dtype=torch.float32))
        lows, highs = zip(*ends, strict=True)
        max_abs[where] = torch.stack(lows + highs).float().abs().view(2, -1).amax(dim=0)
    else:  # the same per-tensor sums, bit for bit
        norms = torch._foreach_norm(present, 2, dtype=torch.float32)
    sum_sq[where] = torch.stack(norms).square()
    # Expensive device-to-host synchronization, torch path only: counting runs where a sum is bad.
    bad = (~torch.isfinite(sum_sq)).nonzero().flatten().tolist()
    for i in bad:
        nonfinite[i] = (~torch.isfinite(grads[i])).sum().float()
    if full and bad:
        max_abs[bad] = torch.where(nonfinite[bad] > 0, float("inf"), max_abs[bad])
    return max_abs, sum_sq, nonfinite


def local_grad_stats(
    named_grads: list[tuple[str, torch.Tensor]],
    device: torch.device,
    full: bool = True,
    use_kernel: bool | None = None,
    stats_kernel: GradStatsKernel | None = None,
) -> GradStats:
    """Statistics of this rank's gradient tensors. `use_kernel`: None picks Triton where it runs
    (CUDA), else the torch fallback. The kernel always yields max |g|; the fallback only if `full`.
    `stats_kernel`: the caller's kernel object (it keeps the address tables between steps)."""
    names = [n for n, _ in named_grads]
    grads = [g for _, g in named_grads]
    if use_kernel is None:
        use_kernel = triton_available(device) and device.type == "cuda"
    with torch.no_grad():  # as detached, without a detach() per tensor (0.4 ms per 1000 on CPU)
        if use_kernel:
            from bigtrain.monitor.kernel import GradStatsKernel

            max_abs, sum_sq, nonfinite = (stats_kernel or GradStatsKernel())(grads, device)
        else:
            max_abs, sum_sq, nonfinite = torch_grad_stats(grads, device, full)
    return GradStats(names, sum_sq, nonfinite, max_abs if full else None)


def grad_slots(num_tensors: int, full: bool) -> list[Slot]:
    """Per tensor the sums of squares and non-finite counts (summed over ranks), on full steps
    max |g| (maxed), and the loss (summed, then the mean: `reduce_grad_stats`)."""
    slots = [Slot(SUM_SQ, num_tensors, "sum"), Slot(NONFINITE, num_tensors, "sum")]
    if full:
        slots.append(Slot(MAX_ABS, num_tensors, "max"))
    return slots + [Slot(LOSS, 1, "sum")]


def stats_values(stats: GradStats) -> dict[str, torch.Tensor]:
    """The statistics by slot name (max |g| where it was computed)."""
    values = {SUM_SQ: stats.sum_sq, NONFINITE: stats.nonfinite}
    return values if stats.max_abs is None else values | {MAX_ABS: stats.max_abs}


def packed_stats(names: list[str], pack: Pack) -> GradStats:
    """The statistics a pack holds (views of its reduced tensors)."""
    return GradStats(names, pack[SUM_SQ], pack[NONFINITE], pack.get(MAX_ABS))


def _all_reduce(flat: torch.Tensor, kind: Reduction) -> None:
    dist.all_reduce(flat, op=dist.ReduceOp.SUM if kind == "sum" else dist.ReduceOp.MAX)


def reduce_grad_stats(pack: Pack, loss_ranks: int) -> Pack:
    """Combine over ranks: one SUM all-reduce of the pack's sum slots (sums of squares,
    non-finite counts, the loss, and what rides along at no extra cost: a preemption request,
    replica differences, router sums) and, when it has max slots (max |g| on full steps, the
    suspicion tier's shard statistics, router extremes), one MAX all-reduce of those. The loss
    comes back as the mean over the `loss_ranks` ranks that hold one (the layout's); every value
    is identical on every rank."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return pack
    if MAX_ABS in pack:
        # NaN does not survive a MAX all-reduce reliably; the kernel already reports it as inf.
        max_abs = pack[MAX_ABS]
        pack = pack.replaced({MAX_ABS: torch.where(max_abs.isnan(), float("inf"), max_abs)})
    reduced = pack.reduce(_all_reduce)
    return reduced.replaced({LOSS: reduced[LOSS] / loss_ranks})


def replica_differences(local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The consistency probe of HSDP replicas, which must hold bit-identical gradient shards after
    their all-reduce: one all-gather of this rank's per-tensor statistics over its replicate
    group; per replica, 1.0 where its statistics differ from replica 0's, else 0.0."""
    rows = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, local, group=group)
    bits = torch.stack(rows).view(torch.int32)  # bitwise: NaN equals the same NaN
    return (bits != bits[0]).any(dim=1).float()


def weighted_stats(stats: GradStats, weights: torch.Tensor | None) -> GradStats:
    """Sums of squares and non-finite counts times a per-tensor weight (1/replication), so that
    the SUM over ranks counts a replicated tensor once; max |g| is unaffected by repetition."""
    if weights is None:
        return stats
    return GradStats(stats.names, stats.sum_sq * weights, stats.nonfinite * weights, stats.max_abs)


def scale_stats(stats: GradStats, factor: float) -> GradStats:
    """Stats of gradients that still carry a loss scale `factor`, as if they had been unscaled."""
    if factor == 1.0:
        return stats
    max_abs = stats.max_abs / factor if stats.max_abs is not None else None
    return GradStats(stats.names, stats.sum_sq / factor**2, stats.nonfinite, max_abs)


def ranked(names: list[str], values: list[float], k: int) -> list[list]:
    """The k (name, value) pairs with the largest values, NaN first, zeros left out."""
    key = [(float("inf") if v != v else v) for v in values]
    order = sorted(range(len(names)), key=lambda i: -key[i])
    return [[names[i], values[i]] for i in order[:k] if key[i] > 0]


_BLOCK = re.compile(r"^(.*?\b(?:blocks|layers|h)\.\d+)\.")


def layer_of(name: str) -> str:
    """The layer a parameter belongs to: `blocks.3` for `blocks.3.attn.q.weight`, else the
    first name component (`tok_emb`, `norm_f`, `lm_head`)."""
    match = _BLOCK.match(name)
    return match.group(1) if match else name.split(".")[0]


def layer_stats(
    names: list[str], sum_sq: list[float], max_abs: list[float]
) -> tuple[dict[str, float], dict[str, float]]:
    """Per-layer gradient norm and max |g| from per-tensor host values, layers in model order."""
    norms: dict[str, float] = {}
    maxes: dict[str, float] = {}
    for name, sq, mx in zip(names, sum_sq, max_abs, strict=True):
        layer = layer_of(name)
        norms[layer] = norms.get(layer, 0.0) + sq
        maxes[layer] = max(maxes.get(layer, 0.0), mx)
    return {k: v**0.5 for k, v in norms.items()}, maxes
