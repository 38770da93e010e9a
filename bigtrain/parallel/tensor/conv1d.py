"""Tensor parallelism of transformers' `Conv1D` (GPT-2's layers: weight (in, out), y = x W + b).

torch's ColwiseParallel/RowwiseParallel know `nn.Linear` and `nn.Embedding` only, and GPT-2's
attention computes q, k and v with ONE layer whose output columns are [q | k | v]. So a matched
Conv1D is replaced (same Parameter names, its weights now DTensors on the tp mesh with plain
placements) by a `TPConv1D` whose forward runs on the local tensors with Megatron's two
operators over the tp process group: `copy_to_tp` (f: identity forward, gradient summed over tp)
and `reduce_from_tp` (g: output summed over tp, identity backward).

- colwise (`mlp.c_fc`): weight Shard(1) (this rank's output columns), bias Shard(0). The input
  is whole on every tp rank; its gradient here is a partial sum: f.
- rowwise (`attn.c_proj`, `mlp.c_proj`): weight Shard(0) (this rank's input rows), bias
  Replicate. The local product is a partial sum: g; the bias is added once, after it.
- colwise_qkv (`attn.c_attn`): weight and bias Replicate, whole on every tp rank (FSDP2 still
  shards them over `shard`). Each rank slices out the columns of its own heads of q, k and v,
  [q_r | k_r | v_r], and computes only those; f on the weight and bias sums their gradients
  (non-zero only in the rank's columns) over tp, so every tp rank holds the same whole gradient,
  as Replicate promises; the input gradient is summed by f as for colwise. The parent's
  `split_size` (GPT2Attention splits the output in three by it) becomes the local width.

Why not a strided shard: DTensor's `_StridedShard(1, split_factor=3)` describes [q_r | k_r | v_r]
and FSDP2 accepts it, but torch.distributed.checkpoint cannot save it ("overlapping chunks").
The price: c_attn's weights, gradients and optimizer states (a quarter of a block's parameters)
are not divided by tp, and its weight gradient is all-reduced over tp each micro-step. bigtrain's
own GPT keeps q, k and v apart and splits them all (configs/parallel/tp2.yaml); it can start
from GPT-2's weights through model.init_from.

Parameters stay DTensors with Shard/Replicate placements, so FSDP2, DCP checkpoints, the
monitor's replication count (mesh.replication) and cross-backend loading treat them as any other
tp layer's. `weight.to_local()` hands autograd the local tensor; its backward returns the
gradient as a DTensor with the parameter's placements, which FSDP2 reduce-scatters over shard.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

# (weight, bias) placements on the tp mesh, by style
PLACEMENTS = {
    "colwise": (Shard(1), Shard(0)),
    "rowwise": (Shard(0), Replicate()),
    "colwise_qkv": (Replicate(), Replicate()),
}

QKV_PARTS = 3  # c_attn's output columns: [q | k | v]


def is_conv1d(module: nn.Module) -> bool:
    """A transformers Conv1D (by name: bigtrain imports transformers only to build hf models)."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


class _CopyToTP(torch.autograd.Function):
    """Megatron's f: identity forward; backward sums the gradient over the tp ranks."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # out of place: autograd may hand the same gradient tensor to another input
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)  # in stream order on GPUs: no host sync
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's g: forward sums the partial outputs over the tp ranks; identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        out = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def copy_to_tp(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _ReduceFromTP.apply(x, group)


def qkv_columns(t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """The columns (last dim) of rank `rank`'s heads of q, k and v: [q_r | k_r | v_r]."""
    return t.unflatten(-1, (QKV_PARTS, size, -1)).select(-2, rank).flatten(-2)


class TPConv1D(nn.Module):
    """A Conv1D split over the tp mesh by `style` (module docstring); holds the layer's
    weight and bias as DTensors under the same names."""

    def __init__(self, source: nn.Module, mesh: DeviceMesh, style: str) -> None:
        super().__init__()
        assert style in PLACEMENTS, style
        assert source.bias is not None, "transformers' Conv1D always has a bias"
        self.nf, self.nx, self.style = source.nf, source.nx, style
        for name, placement in zip(("weight", "bias"), PLACEMENTS[style], strict=True):
            param = getattr(source, name)
            dist_param = distribute_tensor(param, mesh, [placement])
            self.register_parameter(
                name, nn.Parameter(dist_param, requires_grad=param.requires_grad)
            )
        self.group, self.rank, self.size = mesh.get_group(), mesh.get_local_rank(), mesh.size()

    def extra_repr(self) -> str:
        return f"nf={self.nf}, nx={self.nx}, style={self.style}, tp={self.size}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight.to_local(), self.bias.to_local()
        x2d = x.reshape(-1, x.shape[-1])
        if self.style == "rowwise":  # x holds this rank's input features
            y = reduce_from_tp(x2d @ weight, self.group) + bias
        else:
            if self.style == "colwise_qkv":  # gradients of the whole weight summed over tp
                weight = qkv_columns(copy_to_tp(weight, self.group), self.rank, self.size)
                bias = qkv_columns(copy_to_tp(bias, self.group), self.rank, self.size)
            y = torch.addmm(bias, copy_to_tp(x2d, self.group), weight)
        return y.view(*x.shape[:-1], y.shape[-1])


def parallelize_conv1d(block: nn.Module, name: str, style: str, mesh: DeviceMesh) -> None:
    """Replace the Conv1D `name` inside `block` by its TPConv1D (in place); colwise_qkv also
    sets the parent attention's `split_size` (the width of each of q, k, v) to the local one."""
    parent_name, _, child = name.rpartition(".")
    parent = block.get_submodule(parent_name)
    layer = TPConv1D(parent.get_submodule(child), mesh, style)
    if style == "colwise_qkv":
        assert layer.nf % (QKV_PARTS * mesh.size()) == 0, (name, layer.nf)
        assert getattr(parent, "split_size", None) == layer.nf // QKV_PARTS, (
            f"{name}: colwise_qkv expects GPT2Attention's split_size = {layer.nf // QKV_PARTS}"
        )
        parent.split_size = layer.nf // QKV_PARTS // mesh.size()
    setattr(parent, child, layer)
