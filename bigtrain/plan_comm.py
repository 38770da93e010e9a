"""Communication volume of one optimizer step on the fsdp backend's mesh, per rank and mesh axis.

Ring collectives over a group of g ranks, for a tensor of E elements of b bytes each: an
all-gather or a reduce-scatter moves (g - 1) / g x E x b bytes into (and out of) every rank; an
all-reduce twice that (a reduce-scatter plus an all-gather). FSDP2 all-gathers every block's
weights in each micro-batch's forward and, when it reshards after forward, again in backward;
gradients are reduce-scattered over the shard axis once per step (gradient sync on the last
micro-batch only) and, under HSDP, the shard's gradients are all-reduced over the replicate axis.
"""

from __future__ import annotations

from dataclasses import dataclass

from bigtrain.config.schema import Config
from bigtrain.parallel.mesh import mesh_shape


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


def fsdp_traffic(
    cfg: Config, num_params: int, world_size: int, gathered_itemsize: int, reduce_itemsize: int
) -> list[AxisTraffic]:
    """Per mesh axis (shard; replicate under HSDP), what one step moves through each rank."""
    shape = mesh_shape(cfg.parallel, world_size)
    gathers = cfg.train.grad_accum_steps * (2 if cfg.parallel.reshard_after_forward else 1)
    out = [
        AxisTraffic(
            "shard",
            shape.shard,
            f"all-gather x {gathers}",
            gathers * ring_bytes(num_params, shape.shard, gathered_itemsize),
        ),
        AxisTraffic(
            "shard",
            shape.shard,
            "reduce-scatter x 1",
            ring_bytes(num_params, shape.shard, reduce_itemsize),
        ),
    ]
    if shape.replicate > 1:
        shard_elements = num_params / shape.shard
        out.append(
            AxisTraffic(
                "replicate",
                shape.replicate,
                "all-reduce x 1",
                ring_bytes(shard_elements, shape.replicate, reduce_itemsize, all_reduce=True),
            )
        )
    return out
