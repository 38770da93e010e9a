"""Gradient sets and a float64 reference shared by the statistics tests (fallback and kernel)."""

from __future__ import annotations

import torch

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def poisoned_grads(dtype: torch.dtype) -> list[torch.Tensor]:
    """Odd sizes, an empty tensor, a NaN, a +Inf and a -Inf, a tensor spanning several chunks."""
    g = torch.Generator().manual_seed(0)
    grads = [
        torch.randn(1000, 3, generator=g),
        torch.randn(7, generator=g),
        torch.empty(0),
        torch.randn(33, 5, generator=g),
        torch.randn(257, generator=g) * 100,
        torch.randn(20001, generator=g) * 1e-3,
        torch.randn((), generator=g),
        torch.randn(3, generator=g),
    ]
    grads = [t.to(dtype) for t in grads]
    grads[3][2, 1] = float("nan")
    grads[4][-1] = float("inf")
    grads[7][0] = -float("inf")
    grads[7][1] = float("nan")
    return grads


def reference(t: torch.Tensor) -> tuple[float, float, int]:
    """(max |g| with NaN/Inf as inf, sum of squares in float64, non-finite count)."""
    x = t.double()
    nonfinite = int((~torch.isfinite(x)).sum())
    if t.numel() == 0:
        return 0.0, 0.0, 0
    max_abs = float("inf") if nonfinite else float(x.abs().max())
    return max_abs, float((x * x).sum()), nonfinite


def many_chunk_grads(scale: float) -> list[torch.Tensor]:
    """One tensor of 1100 chunks of 256 values (more partials than one fold iteration takes), with
    a NaN, and a small one."""
    g = torch.Generator().manual_seed(int(scale))
    grads = [torch.randn(1100 * 256 - 5, generator=g) * scale, torch.randn(10, generator=g)]
    grads[0][123_456] = float("nan")
    return grads
