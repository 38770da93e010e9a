"""INT8 layers under tensor parallelism: what each tp rank holds and which scales span the ranks.

torch's ColwiseParallel and RowwiseParallel distribute an `Int8Linear` as any `nn.Linear` (it is
one): the weight becomes a DTensor over the tp mesh, and their hooks hand the forward a DTensor
input and turn its DTensor output into the layout the next layer expects. The INT8 forward runs
on the local shards and says how its result is laid out:

- colwise (weight Shard(0), this rank's output rows; the input is whole on every rank): the
  per-output-channel weight scales and the per-token activation scales are local and exact. The
  input gradient is a partial sum (each rank's rows contribute), reduced by the style's hook.
  SmoothQuant's max |W| per input channel spans all rows: a MAX over tp.
- rowwise (weight Shard(1), this rank's input columns; the input is split the same way): each
  output channel's max |W| and each token's max |x| (affine: max and -min) span all columns: one
  MAX over tp, so the quantization grid is the single-process one. The local INT8 product is a
  partial sum of the output (Partial), which the style's hook all-reduces.

The calibration vectors (max |x| per input channel) stay whole on every rank; a rowwise layer
observes its own columns and leaves zeros elsewhere, which the calibration's MAX over all ranks
fills in. So the trainer state holds the same full vectors on any mesh.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Shard

from bigtrain.utils.tensors import local_block

Split = Literal["colwise", "rowwise"]


def tp_split(weight: torch.Tensor) -> Split | None:
    """How tensor parallelism splits a (out, in) weight; None when it is a plain tensor."""
    if not isinstance(weight, DTensor):
        return None
    assert weight.device_mesh.ndim == 1, "the forward sees the weight on the tp mesh only"
    placement = weight.placements[0]
    assert isinstance(placement, Shard) and placement.dim in (0, 1), placement
    return "colwise" if placement.dim == 0 else "rowwise"


def local_input(x: torch.Tensor, split: Split) -> torch.Tensor:
    """This rank's part of the input the style's hook made a DTensor. Colwise: the whole input,
    whose gradient here is this rank's partial sum (the hook's backward all-reduces it)."""
    assert isinstance(x, DTensor), "the ParallelStyle's input hook makes the input a DTensor"
    return x.to_local(grad_placements=[Partial()] if split == "colwise" else None)


def local_output(y: torch.Tensor, mesh: DeviceMesh, split: Split) -> DTensor:
    """The local result as the style's output hook expects it: colwise this rank's output
    features, rowwise a partial sum (the hook reduces it; gradients come back whole)."""
    return DTensor.from_local(y, mesh, [Shard(-1) if split == "colwise" else Partial()])


def input_columns(weight: DTensor) -> slice:
    """The input features a rowwise weight holds here (its DTensor block's columns)."""
    offset, shape = local_block(weight)
    return slice(offset[1], offset[1] + shape[1])


def all_reduce_max(t: torch.Tensor, mesh: DeviceMesh | None) -> torch.Tensor:
    """MAX over the tp ranks, in place (in stream order on GPUs: no host sync); as is when mesh
    is None."""
    if mesh is not None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=mesh.get_group())
    return t
