"""Causal attention over the whole sequence when each cp rank holds only its chunks of it.

`ring`: each rank keeps its queries; the keys and values travel round the cp ranks, one hop a
step (the next hop's transfer runs while this step's blocks compute), and each (query chunk,
key chunk) block's output is merged into the row's result by the blocks' log-sum-exps. The
backward runs the same ring again: each block's gradients come from the kernels' backward given
the merged output and log-sum-exp, and the key/value gradients travel with their keys and
values, one hop more, back to the rank that owns them. Nothing reads a value on the host: the
blocks each step computes depend only on chunk numbers.

`all_to_all` (DeepSpeed-Ulysses): one all-to-all turns each rank's sequence chunk of every
head into the whole sequence of a share of the heads; attention runs as without cp (SDPA, any
kernel); a second all-to-all turns it back. The degree must divide the query heads. Grouped
key/value heads fewer than the degree (or not a multiple of it) are repeated first, each to the
ranks whose query heads read it: more bytes in the all-to-all, the same result.

A document mask (data.document_mask) is given as each token's document number over the whole
sequence (batch, seq): a block's mask is "same document" (and causal on the diagonal), made from
the two chunks' numbers; a row with no allowed key in a block adds nothing to the merge.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from bigtrain.parallel.context import kernels
from bigtrain.parallel.context.split import ContextSplit


class ContextAttention:
    """What the GPT's attention calls in place of SDPA under context parallelism: q (batch,
    heads, local_len, head_dim) and k, v (batch, kv heads, local_len, head_dim) of this rank's
    chunks -> the attention output of those rows over the whole sequence, q's shape."""

    def __init__(self, split: ContextSplit, device_type: str | None = None) -> None:
        self.split = split
        self.device_type = device_type
        """The kernel family (None: the tensors' device; tests pass `cuda` with meta tensors)."""

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        documents: torch.Tensor | None,
        scale: float | None = None,
    ) -> torch.Tensor:
        scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
        if self.split.style == "ring":
            return _Ring.apply(q, k, v, documents, self.split, scale, self.device_type)
        return all_to_all_attention(q, k, v, documents, self.split, scale)


# --- ring ------------------------------------------------------------------------------------


def _pairs(split: ContextSplit, owner: int) -> Iterator[tuple[int, int, int, int]]:
    """(query slot, query chunk, key slot, key chunk) of every block a rank computes with the
    keys of `owner`: a chunk sees the chunks before it whole and itself causally."""
    for i, x in enumerate(split.chunk_ids()):
        for j, y in enumerate(split.chunk_ids(owner)):
            if y <= x:
                yield i, x, j, y


def _block_mask(
    documents: torch.Tensor | None, split: ContextSplit, x: int, y: int, dtype: torch.dtype
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The additive mask of block (x, y) and its rows that see any key (None, None without
    documents: the diagonal is the kernel's causal mask, the rest is whole)."""
    if documents is None:
        return None, None
    qd, kd = split.chunk(documents, x), split.chunk(documents, y)
    allowed = qd.unsqueeze(2) == kd.unsqueeze(1)
    if x == y:
        allowed = allowed & torch.ones_like(allowed[0]).tril()
    return kernels.float_bias(allowed.unsqueeze(1), dtype), allowed.any(-1).unsqueeze(1)


class _Pending:
    """A tensor in flight to the next cp rank and the one coming from the previous."""

    def __init__(self, tensor: torch.Tensor, split: ContextSplit) -> None:
        self.tensor = tensor.contiguous()
        if split.degree == 1:  # a ring of one: the tensor comes back to itself
            self.incoming, self.requests = self.tensor, []
            return
        self.incoming = torch.empty_like(self.tensor)
        ops = [
            dist.P2POp(dist.isend, self.tensor, split.peer(1), split.group),
            dist.P2POp(dist.irecv, self.incoming, split.peer(-1), split.group),
        ]
        self.requests = dist.batch_isend_irecv(ops)

    def wait(self) -> torch.Tensor:
        for request in self.requests:
            request.wait()
        return self.incoming


def _repeat(t: torch.Tensor, groups: int) -> torch.Tensor:
    """Key/value heads repeated for the query heads they serve (grouped-query attention)."""
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _fold(t: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of `_repeat`: each key/value head's query heads summed."""
    if groups == 1:
        return t
    return t.unflatten(1, (t.shape[1] // groups, groups)).sum(2)


def _merge(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> None:
    """Merge a block into the rows' running output and log-sum-exp, in place (FP32)."""
    new = torch.logaddexp(lse, block_lse)
    finite = torch.where(torch.isinf(new), torch.zeros_like(new), new)  # rows nothing sees yet
    out.mul_(torch.exp(lse - finite).unsqueeze(-1))
    out.add_(block_out.float() * torch.exp(block_lse - finite).unsqueeze(-1))
    lse.copy_(new)


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, documents, split: ContextSplit, scale: float, device_type):
        groups = q.shape[1] // k.shape[1]
        n = split.chunk_len(q.shape[2] * split.degree)
        rows = [slice(i * n, (i + 1) * n) for i in range(len(split.chunk_ids()))]
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack((k, v))
        saved = []
        for step in range(split.degree):
            owner = (split.rank - step) % split.degree
            moving = _Pending(kv, split) if step < split.degree - 1 else None
            for i, x, j, y in _pairs(split, owner):
                bias, seen = _block_mask(documents, split, x, y, q.dtype)
                block = kernels.forward(
                    q[:, :, rows[i]],
                    _repeat(kv[0, :, :, rows[j]], groups),
                    _repeat(kv[1, :, :, rows[j]], groups),
                    causal=x == y and bias is None,
                    bias=bias,
                    scale=scale,
                    device_type=device_type,
                )
                block_lse = block.lse if seen is None else block.lse.masked_fill(~seen, -math.inf)
                _merge(out[:, :, rows[i]], lse[:, :, rows[i]], block.out, block_lse)
                saved.append(block.saved)
            if moving is not None:
                kv = moving.wait()
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse, documents)
        ctx.split, ctx.scale, ctx.device_type, ctx.kernel_saved = split, scale, device_type, saved
        return result

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, documents = ctx.saved_tensors
        split: ContextSplit = ctx.split
        groups = q.shape[1] // k.shape[1]
        n = split.chunk_len(q.shape[2] * split.degree)
        rows = [slice(i * n, (i + 1) * n) for i in range(len(split.chunk_ids()))]
        grad = grad.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkv = torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)
        kv = torch.stack((k, v))
        saved = iter(ctx.kernel_saved)
        for step in range(split.degree):
            owner = (split.rank - step) % split.degree
            moving = _Pending(kv, split) if step < split.degree - 1 else None
            for i, x, j, y in _pairs(split, owner):
                bias, _ = _block_mask(documents, split, x, y, q.dtype)
                r, c = rows[i], rows[j]
                g_q, g_k, g_v = kernels.backward(
                    grad[:, :, r],
                    q[:, :, r],
                    _repeat(kv[0, :, :, c], groups),
                    _repeat(kv[1, :, :, c], groups),
                    out[:, :, r],
                    lse[:, :, r].contiguous(),
                    next(saved),
                    causal=x == y and bias is None,
                    bias=bias,
                    scale=ctx.scale,
                    device_type=ctx.device_type,
                )
                dq[:, :, r] += g_q
                dkv[0, :, :, c] += _fold(g_k, groups)
                dkv[1, :, :, c] += _fold(g_v, groups)
            # The gradients of `owner`'s keys and values go on with them: after the last step
            # they reach the rank after this one, which is where they started from.
            returning = _Pending(dkv, split)
            if moving is not None:
                kv = moving.wait()
            dkv = returning.wait()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


# --- all-to-all ------------------------------------------------------------------------------


def _exchange(t: torch.Tensor, split: ContextSplit) -> torch.Tensor:
    """all_to_all over the cp group of a tensor whose first dimension is the degree."""
    out = torch.empty_like(t)
    dist.all_to_all_single(out, t, group=split.group)
    return out


def _seq_to_heads(x: torch.Tensor, split: ContextSplit) -> torch.Tensor:
    """(batch, heads, chunk, dim) of this rank's chunk -> (batch, heads / degree, seq, dim) of
    this rank's share of the heads."""
    b, h, n, d = x.shape
    parts = x.reshape(b, split.degree, h // split.degree, n, d).transpose(0, 1).contiguous()
    return _exchange(parts, split).permute(1, 2, 0, 3, 4).reshape(b, h // split.degree, -1, d)


def _heads_to_seq(y: torch.Tensor, split: ContextSplit) -> torch.Tensor:
    """The inverse of _seq_to_heads."""
    b, h, s, d = y.shape
    parts = y.reshape(b, h, split.degree, s // split.degree, d).permute(2, 0, 1, 3, 4)
    return _exchange(parts.contiguous(), split).transpose(0, 1).reshape(b, -1, s // split.degree, d)


class _Exchange(torch.autograd.Function):
    """_seq_to_heads (`to_heads`) or _heads_to_seq, each the other's backward."""

    @staticmethod
    def forward(ctx, x, split: ContextSplit, to_heads: bool):
        ctx.split, ctx.to_heads = split, to_heads
        return (_seq_to_heads if to_heads else _heads_to_seq)(x, split)

    @staticmethod
    def backward(ctx, grad):
        back = _heads_to_seq if ctx.to_heads else _seq_to_heads
        return back(grad.contiguous(), ctx.split), None, None


def kv_repeats(kv_heads: int, degree: int) -> int:
    """How many times each key/value head is repeated before the all-to-all so that every rank
    gets whole ones: 1 when the degree divides them."""
    return degree // math.gcd(kv_heads, degree)


def all_to_all_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    documents: torch.Tensor | None,
    split: ContextSplit,
    scale: float,
) -> torch.Tensor:
    repeats = kv_repeats(k.shape[1], split.degree)
    k, v = _repeat(k, repeats), _repeat(v, repeats)
    qh, kh, vh = (_Exchange.apply(t, split, True) for t in (q, k, v))
    mask = None
    if documents is not None:
        same = documents.unsqueeze(2) == documents.unsqueeze(1)
        mask = (same & torch.ones_like(same[0]).tril()).unsqueeze(1)
    y = F.scaled_dot_product_attention(
        qh,
        kh,
        vh,
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=kh.shape[1] != qh.shape[1],
    )
    return _Exchange.apply(y, split, False)
