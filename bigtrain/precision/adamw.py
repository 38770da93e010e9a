"""AdamW with its moments stored in FP16 or BF16 and its arithmetic in FP32.

DeepSpeed has no config key for the optimizer state dtype, and torch's AdamW keeps states in the
parameter dtype, so bigtrain brings its own: the same update as torch.optim.AdamW, with each moment
decoded to FP32, updated, and encoded back every step.

- FP16 states carry a per-tensor power-of-two scale (chosen each step so that the tensor's largest
  magnitude sits near 2^14), and the second moment is stored as its square root: g^2 spans twice
  the exponent range of g, and a naive FP16 copy of it underflows (the loss then explodes). With the
  square root and the scale, FP16's 2^40 range covers gradients spanning 2^20.
- BF16 states have FP32's range but 8 bits of mantissa: round-to-nearest loses every increment
  smaller than half an ulp, so a slowly varying moment stalls. Stochastic rounding (add uniform
  noise below the 16 kept bits, truncate) makes the stored value right on average.

Works on plain tensors, FSDP2 DTensor shards (it updates the local shard) and DeepSpeed's flat FP32
partitions (as a client optimizer). Randomness for stochastic rounding comes from torch's default
generator of the parameter's device, which bigtrain checkpoints, so resume stays bit-exact.
"""

from __future__ import annotations

import math
from typing import Any

import torch

FP16_TARGET_EXP = 14  # scale so that amax * scale ~ 2^14, below FP16's max of ~2^16
STATE_KEYS = ("exp_avg", "exp_avg_sq")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def bf16_stochastic(x: torch.Tensor) -> torch.Tensor:
    """FP32 -> BF16 with stochastic rounding: unbiased, E[result] == x."""
    bits = x.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device)
    return ((bits + noise) & -65536).view(torch.float32).to(torch.bfloat16)  # exact: low bits are 0


def fp16_scale_for(x: torch.Tensor) -> torch.Tensor:
    """Power-of-two scale putting x's largest magnitude near 2^14 (1 for an all-zero tensor)."""
    amax = x.abs().amax().float()
    exp = torch.where(
        amax > 0,
        FP16_TARGET_EXP - torch.floor(torch.log2(amax.clamp_min(1e-38))),
        torch.zeros_like(amax),
    )
    return torch.exp2(exp.clamp(-126, 126))


class LowPrecisionAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) with moments stored in `state_dtype` (fp32, bf16 or fp16)."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        state_dtype: torch.dtype = torch.float16,
        rounding: str = "stochastic",
    ) -> None:
        if state_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"state_dtype must be float32, bfloat16 or float16, got {state_dtype}")
        if rounding not in ("stochastic", "nearest"):
            raise ValueError(f"rounding must be 'stochastic' or 'nearest', got {rounding!r}")
        self.state_dtype, self.rounding = state_dtype, rounding
        super().__init__(
            params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        )

    # --- encoding: what is stored for each moment --------------------------------------------------

    def _encode(self, state: dict[str, Any], key: str, value: torch.Tensor) -> None:
        if key == "exp_avg_sq" and self.state_dtype == torch.float16:
            value = value.sqrt()  # stored as sqrt(v): half the exponent range, same update
        if self.state_dtype == torch.float16:
            scale = fp16_scale_for(value)
            state[key] = (value * scale).to(torch.float16)
            state[key + "_scale"] = scale
        elif self.state_dtype == torch.bfloat16:
            state[key] = (
                bf16_stochastic(value)
                if self.rounding == "stochastic"
                else value.to(torch.bfloat16)
            )
        else:
            state[key] = value

    def _decode(self, state: dict[str, Any], key: str) -> torch.Tensor:
        value = state[key].float()
        if self.state_dtype == torch.float16:
            value = value / state[key + "_scale"]
        if key == "exp_avg_sq" and self.state_dtype == torch.float16:
            value = value.square()
        return value

    # --- the update -------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "closures are not supported"
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                param, grad = _local(p), _local(p.grad).float()
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    for (
                        key
                    ) in STATE_KEYS:  # local shard shape; one tensor each (FP32 stores in place)
                        self._encode(state, key, torch.zeros_like(param, dtype=torch.float32))
                state["step"] += 1
                step = state["step"].item()
                m = self._decode(state, "exp_avg").mul_(beta1).add_(grad, alpha=1 - beta1)
                v = (
                    self._decode(state, "exp_avg_sq")
                    .mul_(beta2)
                    .addcmul_(grad, grad, value=1 - beta2)
                )
                denom = (v.sqrt() / math.sqrt(1 - beta2**step)).add_(group["eps"])
                update = (m / (1 - beta1**step)).div_(denom)
                master = param.float()
                master.mul_(1 - group["lr"] * group["weight_decay"]).add_(
                    update, alpha=-group["lr"]
                )
                param.copy_(master)
                self._encode(state, "exp_avg", m)
                self._encode(state, "exp_avg_sq", v)

    # --- checkpoints: always FP32 moments, like torch.optim.AdamW ------------------------------
    # Checkpoints hold decoded FP32 moments (DTensors for FSDP2 shards), so they load into any
    # state dtype and into torch's AdamW; decode/encode round-trips exactly (powers of two, and
    # values already representable), so a resumed run continues bit for bit.

    def state_dict(self) -> dict[str, Any]:
        saved = super().state_dict()
        params = [p for group in self.param_groups for p in group["params"]]
        for index, state in saved["state"].items():
            p = params[index]
            out = {"step": state["step"].clone()}
            for key in STATE_KEYS:
                out[key] = _like(p, self._decode(state, key))
            saved["state"][index] = out
        return saved

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        rounding, self.rounding = self.rounding, "nearest"  # exact for stored values, draws no RNG
        try:
            for state in self.state.values():
                if not state:
                    continue
                decoded = {k: _local(state[k]).float() for k in STATE_KEYS}
                for k in STATE_KEYS:
                    self._encode(state, k, decoded[k])
                step = state["step"]
                state["step"] = (
                    step.detach().float().cpu()
                    if torch.is_tensor(step)
                    else torch.tensor(float(step))
                )
        finally:
            self.rounding = rounding


def _like(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` as a DTensor sharded like `p` when p is one (what DCP needs to save shards)."""
    if hasattr(p, "device_mesh"):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(
            local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )
    return local
