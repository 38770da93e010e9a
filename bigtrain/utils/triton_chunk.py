"""The Triton side of utils/tables.py's chunk tables: which chunk of which tensor a program
reads (imported by the kernels only, where triton runs)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def program_chunk(chunk_tensor, chunk_start):
    """(tensor index, first element) of this program's chunk, from a chunk table
    (utils/tables.py chunk_layout); the start is int64, so tensors beyond 2^31 elements
    index correctly."""
    c = tl.program_id(0)
    return tl.load(chunk_tensor + c), tl.load(chunk_start + c)
