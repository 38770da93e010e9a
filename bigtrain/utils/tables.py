"""Tables of tensor addresses for Triton kernels that walk many tensors in one launch.

A kernel over all gradients (the monitor) or all optimizer states (the fused AdamW) takes the
tensors where they lie: an int64 table holds their addresses and sizes, and each program handles
one chunk of one tensor, so a large embedding spreads over many programs and hundreds of small
vectors cost one launch. The chunk layout depends only on the sizes and is cached. Addresses change
only when a tensor is reallocated (gradients are freed between steps, and the caching allocator
usually hands the same blocks back), so the device copy of a table is rebuilt only when its content
changed. The host side is pinned: from pageable memory CUDA would first wait for the stream to
drain, a host-device synchronisation in every step.
"""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=64)
def chunk_layout(numels: tuple[int, ...], chunk: int) -> tuple[list[int], list[int], list[int]]:
    """(tensor of each chunk, start of each chunk, first chunk of each tensor + the end). Empty
    tensors get no chunk."""
    chunk_tensor: list[int] = []
    chunk_start: list[int] = []
    begin = [0]
    for t, n in enumerate(numels):
        starts = range(0, n, chunk)
        chunk_tensor.extend([t] * len(starts))
        chunk_start.extend(starts)
        begin.append(len(chunk_tensor))
    return chunk_tensor, chunk_start, begin


class DeviceTable:
    """An int64 table on a device, copied from the host only when its values change."""

    def __init__(self) -> None:
        self._values: tuple[int, ...] | None = None
        self._device: torch.device | None = None
        self._table: torch.Tensor | None = None

    def get(self, values: tuple[int, ...], device: torch.device) -> torch.Tensor:
        if self._table is None or values != self._values or device != self._device:
            host = torch.tensor(values, dtype=torch.int64)
            if device.type == "cuda":
                # Pinned: the copy is queued without waiting. A new tensor each time (never
                # written in place), so kernels still reading the previous table are unaffected.
                host = host.pin_memory()
            self._table = host.to(device, non_blocking=True)
            self._values, self._device = values, device
        return self._table
