"""Triton kernels for LowPrecisionAdamW on CUDA: the whole update in one or two launches.

A table holds, per tensor, the addresses of the parameter (FP32 master), its FP32 gradient, the two
stored moments and, for FP16 states, the two per-tensor scales (utils/tables.py); each program
updates one chunk of one tensor. Everything the update needs stays on the device (the per-tensor
bias corrections come as a vector computed there), so `step()` never waits for the GPU.

FP16 states need each tensor's new max |m| and max sqrt(v) before anything can be stored with the
new scale, so they take two launches: the first computes the new moments and folds their maxima
per tensor (`atomic_max` of non-negative floats: exact, the same result in any order); the second
computes them again and writes. Memory traffic is 8 + 20 bytes per parameter, the same 28 as
torch's fused FP32 AdamW (16 read, 12 written); BF16 states take one launch and 20 bytes.

BF16 stochastic rounding draws its noise from Philox (`tl.randint4x`) keyed by a seed drawn each
step from torch's CUDA generator (checkpointed with the run's RNG) and by each value's position.
The torch implementation (adamw_torch.py) is the reference: the tests compare the two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bigtrain.optim.adamw_torch import AdamWHyper, AdamWTensors
from bigtrain.utils.tables import DeviceTable, chunk_layout
from bigtrain.utils.triton_chunk import program_chunk

CHUNK = 16384  # elements per program
BLOCK = 1024  # elements per inner iteration
FIELDS = 8  # per tensor: param, grad, exp_avg, exp_avg_sq, 2 scales, numel, offset
STATE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@triton.jit
def _new_moments(g, m_raw, v_raw, m_scale, v_scale, beta1, beta2, STATE: tl.constexpr):
    """Decode the stored moments, apply this step's gradient; FP32 m, v and sqrt(v)."""
    m = m_raw.to(tl.float32)
    if STATE == 2:  # FP16: scaled m, scaled sqrt(v)
        m = m / m_scale
        r = v_raw.to(tl.float32) / v_scale
        v = r * r
    else:
        v = v_raw.to(tl.float32)
    m = m + (1.0 - beta1) * (g - m)  # torch's lerp for weights < 0.5
    v = v * beta2 + (1.0 - beta2) * g * g
    return m, v, tl.sqrt(v)


@triton.jit
def _fp16_scale(amax):
    """Power of two putting amax near 2^14 (1 for an all-zero tensor), as fp16_scale_for."""
    exp = tl.where(amax > 0, 14.0 - tl.floor(tl.log2(tl.maximum(amax, 1e-38))), 0.0)
    return tl.exp2(tl.minimum(tl.maximum(exp, -126.0), 126.0))


@triton.jit
def _bf16_stochastic(x, noise):
    """Add 16 random bits below BF16's mantissa, truncate: unbiased rounding."""
    bits = x.to(tl.int32, bitcast=True) + (noise & 0xFFFF).to(tl.int32)
    return (bits & -65536).to(tl.float32, bitcast=True).to(tl.bfloat16)


@triton.jit
def _bf16_nearest(x):
    """Round to nearest, ties to even, in integer arithmetic: the same on every backend."""
    bits = x.to(tl.int32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits & -65536).to(tl.float32, bitcast=True).to(tl.bfloat16)


@triton.jit
def _row(table, t, field):
    return tl.load(table + t * 8 + field)  # 8 = FIELDS


@triton.jit
def _tensor(table, t, STATE_DTYPE: tl.constexpr):
    """Tensor t's parameter, gradient and moment pointers, and its size."""
    p_ptr = _row(table, t, 0).to(tl.pointer_type(tl.float32))
    g_ptr = _row(table, t, 1).to(tl.pointer_type(tl.float32))
    m_ptr = _row(table, t, 2).to(tl.pointer_type(STATE_DTYPE))
    v_ptr = _row(table, t, 3).to(tl.pointer_type(STATE_DTYPE))
    return p_ptr, g_ptr, m_ptr, v_ptr, _row(table, t, 6)


@triton.jit
def _scales(table, t):
    """Tensor t's FP16 scales (of m and of sqrt(v))."""
    m_scale = tl.load(_row(table, t, 4).to(tl.pointer_type(tl.float32)))
    return m_scale, tl.load(_row(table, t, 5).to(tl.pointer_type(tl.float32)))


@triton.jit
def _moments_at(
    g_ptr, m_ptr, v_ptr, idx, mask, m_scale, v_scale, beta1, beta2, STATE: tl.constexpr
):
    g = tl.load(g_ptr + idx, mask=mask, other=0.0)
    m_raw = tl.load(m_ptr + idx, mask=mask, other=0.0)
    v_raw = tl.load(v_ptr + idx, mask=mask, other=0.0)
    return _new_moments(g, m_raw, v_raw, m_scale, v_scale, beta1, beta2, STATE)


@triton.jit
def _amax_pass(
    table,
    chunk_tensor,
    chunk_start,
    amax,
    beta1,
    beta2,
    STATE_DTYPE: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """FP16 states: per tensor max |new m| and max sqrt(new v) into amax[2t], amax[2t+1]."""
    t, start = program_chunk(chunk_tensor, chunk_start)
    _, g_ptr, m_ptr, v_ptr, numel = _tensor(table, t, STATE_DTYPE)
    end = tl.minimum(start + CHUNK, numel)
    m_scale, v_scale = _scales(table, t)
    acc_m = tl.zeros([BLOCK], dtype=tl.float32)
    acc_r = tl.zeros([BLOCK], dtype=tl.float32)
    for offset in range(0, CHUNK, BLOCK):
        idx = start + offset + tl.arange(0, BLOCK)
        mask = idx < end
        m, v, r = _moments_at(g_ptr, m_ptr, v_ptr, idx, mask, m_scale, v_scale, beta1, beta2, 2)
        acc_m = tl.maximum(acc_m, tl.abs(m))  # masked lanes hold 0
        acc_r = tl.maximum(acc_r, r)
    tl.atomic_max(amax + 2 * t, tl.max(acc_m, axis=0))
    tl.atomic_max(amax + 2 * t + 1, tl.max(acc_r, axis=0))


@triton.jit
def _update_pass(
    table,
    chunk_tensor,
    chunk_start,
    amax,
    new_scales,
    seed_ptr,
    step_sizes,
    bc2_sqrts,
    lr,
    weight_decay,
    beta1,
    beta2,
    eps,
    STATE: tl.constexpr,
    STATE_DTYPE: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t, start = program_chunk(chunk_tensor, chunk_start)
    p_ptr, g_ptr, m_ptr, v_ptr, numel = _tensor(table, t, STATE_DTYPE)
    end = tl.minimum(start + CHUNK, numel)
    base = _row(table, t, 7)  # position of the tensor's first value among all (RNG offsets)
    step_size = tl.load(step_sizes + t)  # lr / (1 - beta1^step), per tensor
    bc2_sqrt = tl.load(bc2_sqrts + t)  # sqrt(1 - beta2^step)
    decay = 1.0 - lr * weight_decay
    m_scale = 1.0
    v_scale = 1.0
    m_new_scale = 1.0
    v_new_scale = 1.0
    if STATE == 2:
        m_scale, v_scale = _scales(table, t)
        m_new_scale = _fp16_scale(tl.load(amax + 2 * t))
        v_new_scale = _fp16_scale(tl.load(amax + 2 * t + 1))
        first = start == 0  # one program per tensor publishes its new scales
        tl.store(new_scales + 2 * t, m_new_scale, mask=first)
        tl.store(new_scales + 2 * t + 1, v_new_scale, mask=first)
    seed = tl.load(seed_ptr)
    for offset in range(0, CHUNK, BLOCK):
        idx = start + offset + tl.arange(0, BLOCK)
        mask = idx < end
        m, v, r = _moments_at(g_ptr, m_ptr, v_ptr, idx, mask, m_scale, v_scale, beta1, beta2, STATE)
        p = tl.load(p_ptr + idx, mask=mask, other=0.0)
        p = p * decay - step_size * (m / (r / bc2_sqrt + eps))
        tl.store(p_ptr + idx, p, mask=mask)
        if STATE == 2:
            tl.store(m_ptr + idx, (m * m_new_scale).to(tl.float16), mask=mask)
            tl.store(v_ptr + idx, (r * v_new_scale).to(tl.float16), mask=mask)
        elif STATE == 1 and STOCHASTIC:
            noise_m, noise_v, _, _ = tl.randint4x(seed, base + idx)
            tl.store(m_ptr + idx, _bf16_stochastic(m, noise_m), mask=mask)
            tl.store(v_ptr + idx, _bf16_stochastic(v, noise_v), mask=mask)
        elif STATE == 1:
            tl.store(m_ptr + idx, _bf16_nearest(m), mask=mask)
            tl.store(v_ptr + idx, _bf16_nearest(v), mask=mask)
        else:
            tl.store(m_ptr + idx, m, mask=mask)
            tl.store(v_ptr + idx, v, mask=mask)


TL_STATE_DTYPES = {
    torch.float32: tl.float32,
    torch.bfloat16: tl.bfloat16,
    torch.float16: tl.float16,
}


def bias_terms(
    steps: list[torch.Tensor], lr: float, beta1: float, beta2: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per tensor lr / (1 - beta1^t) and sqrt(1 - beta2^t), FP32 vectors on the device. Computed
    in FP64, as torch computes them in Python floats: 1 - 0.999^t loses digits in FP32."""
    t = torch.stack(steps).double()
    step_sizes = lr / (1 - torch.pow(beta1, t))
    bc2_sqrts = (1 - torch.pow(beta2, t)).sqrt()
    return step_sizes.float(), bc2_sqrts.float()


class FusedAdamWKernel:
    """Launches the kernels for one parameter group on one device; keeps its device tables."""

    def __init__(self, chunk: int | None = None, block: int | None = None) -> None:
        self.chunk, self.block = chunk or CHUNK, block or BLOCK
        assert self.chunk % self.block == 0, "a chunk is a whole number of blocks"
        self._table = DeviceTable()
        self._layout = DeviceTable()

    def step(self, tensors: AdamWTensors, hyper: AdamWHyper) -> None:
        """One AdamW step of every tensor (step counters already incremented)."""
        device = tensors.params[0].device
        step_sizes, bc2_sqrts = bias_terms(tensors.steps, hyper.lr, hyper.beta1, hyper.beta2)
        state_dtype = tensors.exp_avgs[0].dtype
        table, chunk_tensor, chunk_start = self._tables(tensors, device)
        num_chunks = chunk_tensor.numel()
        if num_chunks == 0:
            return
        fp16 = state_dtype == torch.float16
        n = len(tensors.params)
        amax = torch.zeros(2 * n if fp16 else 1, dtype=torch.float32, device=device)
        new_scales = torch.empty_like(amax)
        if state_dtype == torch.bfloat16 and hyper.stochastic:
            # Stochastic rounding's seed: drawn on the device from the generator that checkpoints
            # save (no host sync; a resumed run draws the same seeds).
            seed = torch.randint(0, 2**62, (1,), device=device, dtype=torch.int64)
        else:
            seed = torch.zeros(1, dtype=torch.int64, device=device)
        dtype = TL_STATE_DTYPES[state_dtype]
        if fp16:
            _amax_pass[(num_chunks,)](
                table, chunk_tensor, chunk_start, amax, hyper.beta1, hyper.beta2,
                STATE_DTYPE=dtype, CHUNK=self.chunk, BLOCK=self.block,
            )  # fmt: skip
        _update_pass[(num_chunks,)](
            table, chunk_tensor, chunk_start, amax, new_scales, seed, step_sizes, bc2_sqrts,
            hyper.lr, hyper.weight_decay, hyper.beta1, hyper.beta2, hyper.eps,
            STATE=STATE_CODES[state_dtype], STATE_DTYPE=dtype, STOCHASTIC=hyper.stochastic,
            CHUNK=self.chunk, BLOCK=self.block,
        )  # fmt: skip
        if fp16:
            torch._foreach_copy_(
                [*tensors.exp_avg_scales, *tensors.exp_avg_sq_scales],
                [*new_scales[0::2], *new_scales[1::2]],
            )

    def _tables(
        self, tensors: AdamWTensors, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        numels = tuple(p.numel() for p in tensors.params)
        fp16 = bool(tensors.exp_avg_scales)
        rows: list[int] = []
        offset = 0
        for i, p in enumerate(tensors.params):
            # The kernel reads raw memory: FP32 masters and gradients, dense (no strides).
            assert p.dtype == tensors.grads[i].dtype == torch.float32, "FP32 master weights"
            assert p.is_contiguous() and tensors.grads[i].is_contiguous(), "contiguous tensors"
            rows += [
                p.data_ptr(),
                tensors.grads[i].data_ptr(),
                tensors.exp_avgs[i].data_ptr(),
                tensors.exp_avg_sqs[i].data_ptr(),
                tensors.exp_avg_scales[i].data_ptr() if fp16 else 0,
                tensors.exp_avg_sq_scales[i].data_ptr() if fp16 else 0,
                numels[i],
                offset,
            ]
            offset += numels[i]
        chunk_tensor, chunk_start, _ = chunk_layout(numels, self.chunk)
        layout = self._layout.get((*chunk_tensor, *chunk_start), device)
        c = len(chunk_tensor)
        return self._table.get(tuple(rows), device), layout[:c], layout[c:]
