"""Triton kernel: per-tensor max |g|, sum of squares and non-finite count over many gradient tensors
in one pass over their bytes.

The tensors stay where they are: a table of their addresses and sizes is handed to the kernel, and
each program reads one chunk of one tensor (chunks of a large embedding spread over many programs,
so one big tensor does not serialise the launch). A second, tiny launch folds each tensor's chunk
partials in a fixed order: the sums are deterministic, so the clipping norm taken from them is the
same on every run (float atomics would make it vary in the last bits).

Semantics, shared with the torch fallback in stats.py: the sum of squares is accumulated in FP32
and is NaN/Inf when the tensor holds one; max |g| is +Inf when the tensor holds a NaN or an Inf; the
count is exact. Empty tensors give zeros.
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without triton: the torch fallback runs instead
    triton = None

DEFAULT_CHUNK = 32768  # elements per program
DEFAULT_BLOCK = 2048  # elements per inner iteration of a program


def available(device: torch.device) -> bool:
    """Triton can launch on this device (CUDA), or runs in its CPU interpreter (TRITON_INTERPRET)."""
    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:

    @triton.jit
    def _chunk_stats(
        addrs,
        numels,
        chunk_tensor,
        chunk_start,
        part_max,
        part_sq,
        part_bad,
        DTYPE: tl.constexpr,
        CHUNK: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        c = tl.program_id(0)
        t = tl.load(chunk_tensor + c)
        start = tl.load(chunk_start + c)  # int64: tensors beyond 2^31 elements index correctly
        end = tl.minimum(start + CHUNK, tl.load(numels + t))
        base = tl.load(addrs + t).to(tl.pointer_type(DTYPE))
        acc_max = tl.zeros([BLOCK], dtype=tl.float32)
        acc_sq = tl.zeros([BLOCK], dtype=tl.float32)
        acc_bad = tl.zeros([BLOCK], dtype=tl.int32)
        for offset in range(0, CHUNK, BLOCK):
            idx = start + offset + tl.arange(0, BLOCK)
            x = tl.load(base + idx, mask=idx < end, other=0.0).to(tl.float32)
            ax = tl.abs(x)
            finite = ax < float("inf")  # False for NaN and +-Inf; masked lanes are 0.0
            acc_max = tl.maximum(acc_max, tl.where(finite, ax, float("inf")))
            acc_sq += x * x
            acc_bad += (~finite).to(tl.int32)
        tl.store(part_max + c, tl.max(acc_max, axis=0))
        tl.store(part_sq + c, tl.sum(acc_sq, axis=0))
        tl.store(part_bad + c, tl.sum(acc_bad, axis=0))

    @triton.jit
    def _fold_chunks(
        chunk_begin,
        part_max,
        part_sq,
        part_bad,
        out_max,
        out_sq,
        out_bad,
        out_index,
        RBLOCK: tl.constexpr,
    ):
        t = tl.program_id(0)
        lo = tl.load(chunk_begin + t)
        hi = tl.load(chunk_begin + t + 1)
        acc_max = tl.zeros([RBLOCK], dtype=tl.float32)
        acc_sq = tl.zeros([RBLOCK], dtype=tl.float32)
        acc_bad = tl.zeros([RBLOCK], dtype=tl.int32)
        for i in range(lo, hi, RBLOCK):
            idx = i + tl.arange(0, RBLOCK)
            mask = idx < hi
            acc_max = tl.maximum(acc_max, tl.load(part_max + idx, mask=mask, other=0.0))
            acc_sq += tl.load(part_sq + idx, mask=mask, other=0.0)
            acc_bad += tl.load(part_bad + idx, mask=mask, other=0)
        dst = tl.load(out_index + t)
        tl.store(out_max + dst, tl.max(acc_max, axis=0))
        tl.store(out_sq + dst, tl.sum(acc_sq, axis=0))
        tl.store(out_bad + dst, tl.sum(acc_bad, axis=0).to(tl.float32))

    TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@functools.lru_cache(maxsize=64)
def _chunk_layout(numels: tuple[int, ...], chunk: int) -> tuple[list[int], list[int], list[int]]:
    """(tensor of each chunk, start of each chunk, first chunk of each tensor + end). Cached: the
    gradient sizes are the same every step; only their addresses change."""
    chunk_tensor, chunk_start, begin = [], [], [0]
    for t, n in enumerate(numels):
        starts = range(0, n, chunk)
        chunk_tensor.extend([t] * len(starts))
        chunk_start.extend(starts)
        begin.append(len(chunk_tensor))
    return chunk_tensor, chunk_start, begin


def triton_grad_stats(
    grads: list[torch.Tensor],
    device: torch.device,
    chunk: int = DEFAULT_CHUNK,
    block: int = DEFAULT_BLOCK,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(max_abs, sum_sq, nonfinite) as float32 [len(grads)] on `device`; one pass per dtype present
    (gradients normally share one dtype: one launch plus the fold)."""
    assert chunk % block == 0, "a chunk is a whole number of blocks"
    n = len(grads)
    max_abs = torch.zeros(n, dtype=torch.float32, device=device)
    sum_sq = torch.zeros(n, dtype=torch.float32, device=device)
    nonfinite = torch.zeros(n, dtype=torch.float32, device=device)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, g in enumerate(grads):
        if g.numel():
            by_dtype.setdefault(g.dtype, []).append(i)
    for dtype, index in by_dtype.items():
        if dtype not in TL_DTYPES:
            raise TypeError(f"gradient statistics support float32, bfloat16, float16, not {dtype}")
        tensors = [grads[i].contiguous() for i in index]  # gradients are contiguous: no copy
        chunk_tensor, chunk_start, begin = _chunk_layout(tuple(t.numel() for t in tensors), chunk)
        # One small host-to-device copy of the tables (addresses change whenever grads are freed).
        tables = torch.tensor(
            [
                *[t.data_ptr() for t in tensors],
                *[t.numel() for t in tensors],
                *chunk_tensor,
                *chunk_start,
                *begin,
                *index,
            ],
            dtype=torch.int64,
        ).to(device, non_blocking=True)
        m, c = len(tensors), len(chunk_tensor)
        addrs, numels, ctensor, cstart, cbegin, out_index = torch.split(
            tables, [m, m, c, c, m + 1, m]
        )
        part_max = torch.empty(c, dtype=torch.float32, device=device)
        part_sq = torch.empty(c, dtype=torch.float32, device=device)
        part_bad = torch.empty(c, dtype=torch.int32, device=device)
        _chunk_stats[(c,)](
            addrs,
            numels,
            ctensor,
            cstart,
            part_max,
            part_sq,
            part_bad,
            DTYPE=TL_DTYPES[dtype],
            CHUNK=chunk,
            BLOCK=block,
        )
        _fold_chunks[(m,)](
            cbegin, part_max, part_sq, part_bad, max_abs, sum_sq, nonfinite, out_index, RBLOCK=128
        )
    return max_abs, sum_sq, nonfinite
