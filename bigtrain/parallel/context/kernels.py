"""Attention kernels that return the log-sum-exp of each query row's scores, which a ring needs
to merge the partial results of several key blocks, and whose backward takes the merged output
and log-sum-exp (so each block's gradients are those of the whole row's softmax).

Shapes are SDPA's: q (batch, heads, q_len, head_dim), k and v (batch, heads, k_len, head_dim)
with as many heads as q (the ring repeats grouped key/value heads per block). `bias` is None or
an additive float mask (batch, 1, q_len, k_len) in q's dtype: 0 where allowed, -inf where not.
The log-sum-exp is FP32 (batch, heads, q_len) on every device.

CPU: `_scaled_dot_product_flash_attention_for_cpu` (and its backward), the kernel SDPA itself
runs on CPU; a row whose every key is masked gives output 0 and log-sum-exp 0, which the ring
corrects (`attention.visible_rows`). CUDA: SDPA's flash kernel without a mask, its
memory-efficient kernel with one (flash takes no mask). Both CUDA paths are written for what a
CPU test can check (tests/parallel/test_context.py runs them on meta tensors: shapes, dtypes,
the padded log-sum-exp of the efficient kernel); their numbers are for a GPU to show.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

aten = torch.ops.aten


class Block(NamedTuple):
    out: torch.Tensor
    lse: torch.Tensor
    """FP32 (batch, heads, q_len)."""
    saved: tuple
    """What the kernel's backward needs beyond q, k, v, out and lse (CUDA: its RNG state and
    sequence bounds; nothing on CPU)."""


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    bias: torch.Tensor | None,
    scale: float,
    device_type: str | None = None,
) -> Block:
    """One block's attention output and log-sum-exp. device_type: the kernel family to use
    (default: q's device; tests pass `cuda` with meta tensors)."""
    kind = device_type or q.device.type
    if kind == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=bias, scale=scale
        )
        return Block(out, lse, ())
    if bias is None:
        out, lse, cum_q, cum_k, max_q, max_k, rng, unused, _ = (
            aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        )
        return Block(out, lse, (cum_q, cum_k, max_q, max_k, rng, unused))
    padded = _aligned(bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2]))
    out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(
        q, k, v, padded, True, 0.0, causal, scale=scale
    )
    # The efficient kernel may pad the log-sum-exp's rows (to a multiple of 32); the ring
    # merges the true rows, and `backward` pads the merged one back.
    return Block(out, lse[..., : q.shape[2]], (seed, offset, lse.shape[-1], padded))


def backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    saved: tuple,
    *,
    causal: bool,
    bias: torch.Tensor | None,
    scale: float,
    device_type: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of one block, given the whole row's output and log-sum-exp (`out`, `lse`):
    the block's probabilities are then exp(scores - lse), its share of the row's softmax."""
    kind = device_type or q.device.type
    if kind == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale
        )
    if bias is None:
        cum_q, cum_k, max_q, max_k, rng, unused = saved
        return aten._scaled_dot_product_flash_attention_backward(
            grad_out,
            q,
            k,
            v,
            out,
            lse,
            cum_q,
            cum_k,
            max_q,
            max_k,
            0.0,
            causal,
            rng,
            unused,
            scale=scale,
        )
    seed, offset, width, padded = saved
    if width > lse.shape[-1]:
        lse = torch.nn.functional.pad(lse, (0, width - lse.shape[-1]))
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        grad_out,
        q,
        k,
        v,
        padded,
        out,
        lse.contiguous(),
        seed,
        offset,
        0.0,
        [True, True, True, False],
        causal,
        scale=scale,
    )
    return dq, dk, dv


def _aligned(bias: torch.Tensor, multiple: int = 16) -> torch.Tensor:
    """The bias in memory whose rows start at multiples of `multiple` elements, as the
    memory-efficient kernel needs (SDPA pads its masks the same way); the same values."""
    width = bias.shape[-1]
    if width % multiple == 0 and bias.is_contiguous():
        return bias
    wide = bias.new_empty(*bias.shape[:-1], -(-width // multiple) * multiple)
    wide = wide[..., :width]
    wide.copy_(bias)
    return wide


def float_bias(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True: allowed) as the additive mask the kernels take."""
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(
        allowed, zero, torch.tensor(float("-inf"), dtype=dtype, device=allowed.device)
    )
