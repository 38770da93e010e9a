"""Small tensor helpers shared across layers."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


def autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """A region computed in the inputs' own dtypes. Meta tensors (used to check shapes and device
    placement without memory) have no autocast to switch off."""
    if device_type == "meta":
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast computes in on this device type right now, None when it is off."""
    if device_type == "meta" or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def host_ready(device: torch.device) -> torch.cuda.Event | None:
    """An event after the host copies queued so far (CUDA copies are non-blocking); a background
    writer waits for it before reading them. None where copies complete at once."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; a plain tensor as is. A shard that only wraps a plain tensor
    (torchao's weight that FSDP2 gathers in FP8) as that tensor: checkpoints, snapshots and
    loads see the values, never the subclass."""
    return plain_tensor(t.to_local() if hasattr(t, "to_local") else t)


def plain_tensor(t: torch.Tensor) -> torch.Tensor:
    """A tensor subclass that only wraps a plain tensor (torchao's weight that FSDP2 gathers in
    FP8 holds its high-precision values in `_tensor`) as that tensor; any other as is."""
    while type(t) is not torch.Tensor:  # (not isinstance: a Parameter's check is by a flag)
        inner = getattr(t, "_tensor", None)
        if not isinstance(inner, torch.Tensor):
            break
        t = inner
    return t


def local_block(p: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offset, shape) of this rank's block of a parameter: its DTensor shard, or all of it."""
    if isinstance(p, DTensor):
        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        return tuple(offset), tuple(shape)
    return (0,) * p.dim(), tuple(p.shape)


def full_shape(t: torch.Tensor) -> torch.Size:
    """A parameter's whole shape, also where ZeRO-3 has partitioned it (its own shape is then
    (0,): `ds_shape` keeps the real one)."""
    return getattr(t, "ds_shape", t.shape)


def to_cpu(obj: Any, into: Any = None) -> Any:
    """Host copies of the tensors in `obj`. From CUDA: into pinned memory, without waiting (the
    copy is ordered on the stream before later kernels that change the source, and before any
    later copy back, so no synchronisation is needed). `into`: an earlier result of the same
    structure whose tensors are reused where they fit (warm host pages copy several times faster
    than fresh ones)."""
    if isinstance(obj, torch.Tensor):
        t = local_tensor(obj).detach()
        if (
            isinstance(into, torch.Tensor)
            and into.shape == t.shape
            and into.dtype == t.dtype
            and (not t.is_cuda or into.is_pinned())
        ):
            return into.copy_(t, non_blocking=t.is_cuda)
        if t.is_cuda:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return host.copy_(t, non_blocking=True)
        return t.to("cpu", copy=True)
    if isinstance(obj, dict):
        into = into if isinstance(into, dict) else {}
        return {k: to_cpu(v, into.get(k)) for k, v in obj.items()}
    if isinstance(obj, list):
        into = into if isinstance(into, list) and len(into) == len(obj) else [None] * len(obj)
        return [to_cpu(v, old) for v, old in zip(obj, into, strict=True)]
    return obj
