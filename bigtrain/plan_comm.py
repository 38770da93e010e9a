"""Communication volume of one optimizer step on the fsdp backend's mesh, per rank and mesh axis,
and what tensor parallelism splits (for the states per rank).

Ring collectives over a group of g ranks, for a tensor of E elements of b bytes each: an
all-gather or a reduce-scatter moves (g - 1) / g x E x b bytes into (and out of) every rank; an
all-reduce twice that (a reduce-scatter plus an all-gather). FSDP2 all-gathers every block's
weights in each micro-batch's forward and, when it reshards after forward, again in backward;
gradients are reduce-scattered over the shard axis once per step (gradient sync on the last
micro-batch only) and, under HSDP, the shard's gradients are all-reduced over the replicate axis.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from bigtrain.config.schema import Config
from bigtrain.parallel.apply import transformer_blocks
from bigtrain.parallel.mesh import mesh_shape
from bigtrain.parallel.tensor_parallel import block_plan


def ring_bytes(elements: float, group: int, itemsize: int, all_reduce: bool = False) -> float:
    """Bytes each rank receives in a ring all-gather/reduce-scatter (or all-reduce)."""
    if group <= 1:
        return 0.0
    return (2.0 if all_reduce else 1.0) * (group - 1) / group * elements * itemsize


@dataclass(frozen=True)
class AxisTraffic:
    """One mesh axis's traffic per optimizer step and rank."""

    axis: str
    size: int
    collective: str
    bytes_per_step: float


@dataclass(frozen=True)
class TPLayout:
    """What tensor parallelism splits: the parameters of the tp_plan's layers (all blocks), and
    per block the number of colwise and rowwise layers."""

    split_params: int = 0
    colwise: int = 0
    rowwise: int = 0
    num_blocks: int = 0

    def per_rank_params(self, num_params: int, tp: int) -> float:
        """Parameters a tp rank holds before FSDP2 shards them: its slice of the split layers."""
        return num_params - self.split_params + self.split_params / tp


def tp_layout(model: nn.Module, patterns: dict[str, str]) -> TPLayout:
    """Count what `patterns` split in a (meta-device) model."""
    blocks = transformer_blocks(model)
    plan = block_plan(blocks[0], patterns)
    split = sum(
        p.numel() for b in blocks for name in plan for p in b.get_submodule(name).parameters()
    )
    styles = list(plan.values())
    return TPLayout(split, styles.count("colwise"), styles.count("rowwise"), len(blocks))


def fsdp_traffic(
    cfg: Config,
    num_params: int,
    world_size: int,
    gathered_itemsize: int,
    reduce_itemsize: int,
    tp: TPLayout | None = None,
    activation_bytes: float = 0.0,
) -> list[AxisTraffic]:
    """Per mesh axis (tp, shard, replicate), what one step moves through each rank.
    `activation_bytes`: one micro-batch's residual stream (micro x seq x d_model, compute dtype),
    which tensor parallelism all-reduces after each rowwise layer (forward) and before each
    colwise one (backward); activation recompute adds forward ones, not counted here."""
    shape = mesh_shape(cfg.parallel, world_size)
    tp = tp or TPLayout()
    held = tp.per_rank_params(num_params, shape.tp)  # what FSDP2 shards on this tp rank
    accum = cfg.train.grad_accum_steps
    gathers = accum * (2 if cfg.parallel.reshard_after_forward else 1)
    out = []
    if shape.tp > 1:
        count = accum * tp.num_blocks * (tp.colwise + tp.rowwise)
        out.append(
            AxisTraffic(
                "tp",
                shape.tp,
                f"all-reduce x {count}",
                count * ring_bytes(activation_bytes, shape.tp, 1, all_reduce=True),
            )
        )
    out += [
        AxisTraffic(
            "shard",
            shape.shard,
            f"all-gather x {gathers}",
            gathers * ring_bytes(held, shape.shard, gathered_itemsize),
        ),
        AxisTraffic(
            "shard",
            shape.shard,
            "reduce-scatter x 1",
            ring_bytes(held, shape.shard, reduce_itemsize),
        ),
    ]
    if shape.replicate > 1:
        shard_elements = held / shape.shard
        out.append(
            AxisTraffic(
                "replicate",
                shape.replicate,
                "all-reduce x 1",
                ring_bytes(shard_elements, shape.replicate, reduce_itemsize, all_reduce=True),
            )
        )
    return out
