"""Triton kernel: per-tensor max |g|, sum of squares and non-finite count over many gradient tensors
in one pass over their bytes.

The tensors stay where they are: a table of their addresses and sizes is handed to the kernel
(utils/tables.py), and each program reads one chunk of one tensor, so a large tensor spreads over
many programs and the GPU fills with work from 10M values up. A second, tiny launch folds each
tensor's chunk partials in a fixed order: the sums are deterministic, so the clipping norm taken
from them is the same on every run (float atomics would make it vary in the last bits).

Semantics, shared with the torch fallback in stats.py: the sum of squares is accumulated in FP32
and is NaN/Inf when the tensor holds one; max |g| is +Inf when the tensor holds a NaN or an Inf; the
count is exact. Empty tensors give zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bigtrain.utils.tables import DeviceTable, chunk_layout
from bigtrain.utils.triton_chunk import program_chunk

DEFAULT_CHUNK = 16384  # elements per program (64 KB of FP32): 61K programs for 1B values
DEFAULT_BLOCK = 2048  # elements per inner iteration of a program
FOLD_BLOCK = 1024  # chunk partials per iteration of the fold


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
    t, start = program_chunk(chunk_tensor, chunk_start)
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
    out,
    out_index,
    n_out,
    NUM_ITERS: tl.constexpr,
    RBLOCK: tl.constexpr,
):
    # NUM_ITERS is a compile-time bound (the largest tensor's chunk count, rounded up to a
    # power of two): loop bounds loaded from memory break Triton's interpreter (3.6).
    t = tl.program_id(0)
    lo = tl.load(chunk_begin + t)
    hi = tl.load(chunk_begin + t + 1)
    acc_max = tl.zeros([RBLOCK], dtype=tl.float32)
    acc_sq = tl.zeros([RBLOCK], dtype=tl.float32)
    acc_bad = tl.zeros([RBLOCK], dtype=tl.int32)
    for i in range(0, NUM_ITERS):
        idx = lo + i * RBLOCK + tl.arange(0, RBLOCK)
        mask = idx < hi
        acc_max = tl.maximum(acc_max, tl.load(part_max + idx, mask=mask, other=0.0))
        acc_sq += tl.load(part_sq + idx, mask=mask, other=0.0)
        acc_bad += tl.load(part_bad + idx, mask=mask, other=0)
    dst = tl.load(out_index + t)
    tl.store(out + dst, tl.max(acc_max, axis=0))
    tl.store(out + n_out + dst, tl.sum(acc_sq, axis=0))
    tl.store(out + 2 * n_out + dst, tl.sum(acc_bad, axis=0).to(tl.float32))


TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


class GradStatsKernel:
    """The two launches over a list of gradients; keeps the device tables between steps (they
    are copied again only when a gradient moved)."""

    def __init__(self, chunk: int = DEFAULT_CHUNK, block: int = DEFAULT_BLOCK) -> None:
        assert chunk % block == 0, "a chunk is a whole number of blocks"
        self.chunk, self.block = chunk, block
        self._tables: dict[torch.dtype, DeviceTable] = {}

    def __call__(
        self, grads: list[torch.Tensor], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(max_abs, sum_sq, nonfinite) as float32 [len(grads)] on `device`; one pass per dtype
        present (gradients normally share one dtype: one launch plus the fold)."""
        n = len(grads)
        # Every slot is written by a fold program (empty tensors fold nothing: zeros), so the
        # output needs no initialisation.
        out = torch.empty(3, n, dtype=torch.float32, device=device)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, g in enumerate(grads):
            by_dtype.setdefault(g.dtype, []).append(i)
        for dtype, index in by_dtype.items():
            if dtype not in TL_DTYPES:
                raise TypeError(
                    f"gradient statistics support float32, bfloat16, float16, not {dtype}"
                )
            self._launch([grads[i] for i in index], index, dtype, out, device)
        return out[0], out[1], out[2]

    def _launch(self, tensors, index, dtype, out, device) -> None:
        numels = tuple(t.numel() for t in tensors)
        chunk_tensor, chunk_start, begin = chunk_layout(numels, self.chunk)
        m, c = len(tensors), len(chunk_tensor)
        values = (
            *(t.data_ptr() if t.numel() else 0 for t in tensors),
            *numels,
            *chunk_tensor,
            *chunk_start,
            *begin,
            *index,
        )
        table = self._tables.setdefault(dtype, DeviceTable()).get(values, device)
        addrs, numel_t, ctensor, cstart, cbegin, out_index = torch.split(
            table, [m, m, c, c, m + 1, m]
        )
        parts = torch.empty(3, max(c, 1), dtype=torch.float32, device=device)
        part_bad = parts[2].view(torch.int32)  # an int32 view of the third row
        if c:
            for t in tensors:
                assert t.is_contiguous(), "gradients are contiguous"
            _chunk_stats[(c,)](
                addrs, numel_t, ctensor, cstart, parts[0], parts[1], part_bad,
                DTYPE=TL_DTYPES[dtype], CHUNK=self.chunk, BLOCK=self.block,
            )  # fmt: skip
        most = max(b - a for a, b in zip(begin[:-1], begin[1:], strict=True))
        iters = 1 << max(0, (-(-most // FOLD_BLOCK) - 1).bit_length())
        _fold_chunks[(m,)](
            cbegin, parts[0], parts[1], part_bad, out, out_index, out.shape[1],
            NUM_ITERS=iters, RBLOCK=FOLD_BLOCK,
        )  # fmt: skip


def triton_grad_stats(
    grads: list[torch.Tensor],
    device: torch.device,
    chunk: int = DEFAULT_CHUNK,
    block: int = DEFAULT_BLOCK,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One-off form of GradStatsKernel (tests, benchmarks)."""
    return GradStatsKernel(chunk, block)(grads, device)
