"""LowPrecisionAdamW's update with torch ops: the implementation on CPU, and on CUDA where Triton is
missing (adamw_kernel.py has the fused CUDA one).

The arithmetic is torch's own fused AdamW (`torch._fused_adamw_`, one multi-tensor pass, bias
corrections read from the step tensors on the device): FP32 states are updated in place, exactly
as torch.optim.AdamW(fused=True) would. FP16 and BF16 states are decoded to FP32 temporaries first
and encoded back after, in chunks of at most `CHUNK_NUMEL` values so that the temporaries stay
bounded (a tensor larger than that is a chunk of its own). Per-tensor quantities (FP16 scales) stay
on the device; nothing here reads a device value on the host.

Stored forms: FP16 moments hold m * s_m and sqrt(v) * s_v with power-of-two per-tensor scales
chosen each step from the new values (largest magnitude near 2^14). BF16 moments are rounded
stochastically: 16 random bits added below BF16's mantissa, then truncated, so that the stored
value is right on average. The bits come from `NoisePool`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

FP16_TARGET_EXP = 14  # scale so that amax * scale ~ 2^14, below FP16's max of ~2^16
CHUNK_NUMEL = 1 << 24  # values per chunk: FP32 temporaries of 64 MB each


@dataclass(frozen=True)
class AdamWHyper:
    """One parameter group's settings for one step."""

    lr: float
    weight_decay: float
    beta1: float
    beta2: float
    eps: float
    stochastic: bool  # BF16 states: stochastic rounding, else round to nearest


@dataclass
class AdamWTensors:
    """One parameter group's tensors on one device, index-aligned: local shards, contiguous."""

    params: list[torch.Tensor]  # FP32 master weights, updated in place
    grads: list[torch.Tensor]  # FP32
    exp_avgs: list[torch.Tensor]  # stored form (see module docstring)
    exp_avg_sqs: list[torch.Tensor]
    steps: list[torch.Tensor]  # 0-dim FP32 counters on the device
    exp_avg_scales: list[torch.Tensor] = field(default_factory=list)  # FP16 states only
    exp_avg_sq_scales: list[torch.Tensor] = field(default_factory=list)

    def select(self, lo: int, hi: int) -> AdamWTensors:
        """Tensors lo..hi-1."""
        return AdamWTensors(*(getattr(self, f)[lo:hi] for f in self.__dataclass_fields__))


def fp16_scales(amax: torch.Tensor) -> torch.Tensor:
    """Power-of-two scales putting each amax near 2^14 (1 for an all-zero tensor)."""
    amax = amax.float()
    exp = torch.where(
        amax > 0,
        FP16_TARGET_EXP - torch.floor(torch.log2(amax.clamp_min(1e-38))),
        torch.zeros_like(amax),
    )
    return torch.exp2(exp.clamp(-126, 126))


def bf16_stochastic(x: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
    """FP32 -> BF16 with stochastic rounding: unbiased, E[result] == x. `noise`: 16 random bits
    per value (int32, x's shape), drawn from torch's generator when None."""
    bits = x.contiguous().view(torch.int32)
    if noise is None:
        noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device)
    return ((bits + noise) & -65536).view(torch.float32).to(torch.bfloat16)  # exact: low bits 0


class NoisePool:
    """Random 16-bit values for stochastic rounding, cheap to draw: a fixed pool in which every
    value 0..65535 occurs equally often, read from a random offset for each piece of each tensor.
    For a uniform offset each position's noise is exactly uniform, so rounding stays unbiased;
    drawing 16 random bits per value from torch's generator costs more than the AdamW step.

    The offsets come from Python's `random`, whose state bigtrain checkpoints and snapshots, so
    a resumed or rolled-back run draws the same noise; being host numbers, they cost no sync."""

    SIZE = 1 << 20

    def __init__(self) -> None:
        self._pools: dict[torch.device, torch.Tensor] = {}

    def _pool(self, device: torch.device) -> torch.Tensor:
        if device not in self._pools:
            gen = torch.Generator().manual_seed(0x5EED)  # fixed: leaves the run's RNG untouched
            values = torch.arange(self.SIZE, dtype=torch.int32) % (1 << 16)
            pool = values[torch.randperm(self.SIZE, generator=gen)]
            self._pools[device] = torch.cat([pool, pool]).to(device)  # any window is a view
        return self._pools[device]

    def add_to(self, bits: torch.Tensor) -> None:
        """bits (int32, flat) += noise, piece by piece (SIZE values each, own random offset)."""
        pool = self._pool(bits.device)
        for start in range(0, bits.numel(), self.SIZE):
            piece = bits[start : start + self.SIZE]
            offset = random.randrange(self.SIZE)
            piece.add_(pool[offset : offset + piece.numel()])


class Scratch:
    """Flat FP32 work buffers for the decoded moments of a chunk, with views shaped like its
    tensors. Kept between steps on the CPU (touching fresh pages costs more there than the
    arithmetic), taken from the caching allocator on other devices (no memory held between
    steps)."""

    def __init__(self) -> None:
        self._kept: dict[torch.device, torch.Tensor] = {}
        self._views: dict[tuple, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}

    def get(
        self, params: list[torch.Tensor]
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """(flat buffer of 2 x numel, views for m, views for v)."""
        device = params[0].device
        numel = sum(p.numel() for p in params)
        if device.type != "cpu":
            flat = torch.empty(2 * numel, dtype=torch.float32, device=device)
            return flat, *self._split(flat, params)
        kept = self._kept.get(device)
        if kept is None or kept.numel() < 2 * numel:
            kept = self._kept[device] = torch.empty(2 * numel, dtype=torch.float32)
            self._views.clear()
        flat = kept[: 2 * numel]
        key = (flat.data_ptr(), tuple(p.shape for p in params))
        if key not in self._views:
            self._views[key] = self._split(flat, params)
        return flat, *self._views[key]

    @staticmethod
    def _split(flat, params) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        sizes = [p.numel() for p in params]
        views = [v.view(p.shape) for v, p in zip(flat.split(sizes * 2), params * 2, strict=True)]
        return views[: len(params)], views[len(params) :]


def torch_step(ts: AdamWTensors, hyper: AdamWHyper, noise: NoisePool, scratch: Scratch) -> None:
    """One AdamW step of every tensor in `ts` (steps already incremented)."""
    for lo, hi in _chunks([p.numel() for p in ts.params], CHUNK_NUMEL):
        part = ts.select(lo, hi)
        fp32 = part.exp_avgs[0].dtype == torch.float32
        flat, m, v = (None, part.exp_avgs, part.exp_avg_sqs) if fp32 else scratch.get(part.params)
        if not fp32:
            _decode(part, flat, m, v)
        torch._fused_adamw_(
            part.params,
            part.grads,
            m,
            v,
            [],
            part.steps,
            lr=hyper.lr,
            beta1=hyper.beta1,
            beta2=hyper.beta2,
            weight_decay=hyper.weight_decay,
            eps=hyper.eps,
            amsgrad=False,
            maximize=False,
        )
        if not fp32:
            _encode(part, flat, m, v, hyper.stochastic, noise)


def _chunks(numels: list[int], limit: int) -> list[tuple[int, int]]:
    """Consecutive ranges of tensors holding at most `limit` values (or one larger tensor)."""
    bounds, size = [0], 0
    for i, n in enumerate(numels):
        if i > bounds[-1] and size + n > limit:
            bounds.append(i)
            size = 0
        size += n
    bounds.append(len(numels))
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def _decode(ts: AdamWTensors, flat: torch.Tensor, m: list, v: list) -> None:
    """The stored moments into the FP32 views m and v (flat: both, back to back)."""
    torch._foreach_copy_(m, ts.exp_avgs)
    torch._foreach_copy_(v, ts.exp_avg_sqs)
    if ts.exp_avgs[0].dtype == torch.float16:
        torch._foreach_div_(m + v, ts.exp_avg_scales + ts.exp_avg_sq_scales)
        second = flat[flat.numel() // 2 :]
        second.square_()  # stored as sqrt(v)


def _encode(
    ts: AdamWTensors, flat: torch.Tensor, m: list, v: list, stochastic: bool, noise: NoisePool
) -> None:
    if ts.exp_avgs[0].dtype == torch.float16:
        flat[flat.numel() // 2 :].sqrt_()
        # max |m| from one aminmax pass per tensor (_foreach_norm(inf) is ~5x slower on CPU)
        lows, highs = zip(*(torch.aminmax(x) for x in m), strict=True)
        amax_m = torch.maximum(torch.stack(lows).abs(), torch.stack(highs).abs())
        amax_v = torch.stack(torch._foreach_max(v))  # sqrt(v) >= 0
        scales = list(fp16_scales(torch.cat([amax_m, amax_v])).unbind())
        torch._foreach_mul_(m + v, scales)
        torch._foreach_copy_(ts.exp_avg_scales + ts.exp_avg_sq_scales, scales)
    elif stochastic:
        bits = flat.view(torch.int32)
        noise.add_to(bits)
        bits.bitwise_and_(-65536)  # the low 16 bits go: exact BF16 values
    torch._foreach_copy_(ts.exp_avgs + ts.exp_avg_sqs, m + v)
