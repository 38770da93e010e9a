"""Collectives that also work in one process (no process group): every layer may use them."""

from __future__ import annotations

import torch
import torch.distributed as dist


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_gather_objects(obj):
    """[obj of rank 0, obj of rank 1, ...]; [obj] in one process."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def all_true(flag: bool) -> bool:
    """True on every rank iff flag is True on every rank."""
    if not dist.is_initialized():
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def from_rank0(t: torch.Tensor) -> torch.Tensor:
    """Rank 0's value of `t` (a tensor on the process group's device) on every rank; `t` in one
    process."""
    if dist.is_initialized():
        dist.broadcast(t, src=0)
    return t
