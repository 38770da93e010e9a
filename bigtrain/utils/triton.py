"""Triton where it can run: CUDA devices, or its CPU interpreter (TRITON_INTERPRET=1, tests)."""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without triton: the torch implementations run instead
    triton = tl = None


def triton_available(device: torch.device) -> bool:
    """Triton can launch on this device (CUDA), or runs in its CPU interpreter (TRITON_INTERPRET)."""
    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:

    @triton.jit
    def program_chunk(chunk_tensor, chunk_start):
        """(tensor index, first element) of this program's chunk, from a chunk table
        (utils/tables.py chunk_layout); the start is int64, so tensors beyond 2^31 elements
        index correctly."""
        c = tl.program_id(0)
        return tl.load(chunk_tensor + c), tl.load(chunk_start + c)
