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

`step()` updates every tensor of a parameter group at once: a fused Triton kernel on CUDA
(adamw_kernel.py), multi-tensor torch ops elsewhere (adamw_foreach.py). Step counters, bias
corrections and FP16 scales stay on the device, so a step never waits for the GPU.

Works on plain tensors, FSDP2 DTensor shards (it updates the local shard) and DeepSpeed's flat FP32
partitions (as a client optimizer). Stochastic rounding draws from torch's generator of the
parameter's device, which bigtrain checkpoints, so resume stays bit-exact.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from bigtrain.utils.triton import triton_available

if TYPE_CHECKING:
    from bigtrain.optim.adamw_kernel import FusedAdamWKernel
from bigtrain.optim.adamw_torch import (
    AdamWHyper,
    AdamWTensors,
    NoisePool,
    Scratch,
    bf16_stochastic,
    fp16_scales,
    torch_step,
)
from bigtrain.utils.tensors import local_tensor

STATE_KEYS = ("exp_avg", "exp_avg_sq")
__all__ = ["LowPrecisionAdamW", "bf16_stochastic", "fp16_scale_for"]


def fp16_scale_for(x: torch.Tensor) -> torch.Tensor:
    """Power-of-two scale putting x's largest magnitude near 2^14 (1 for an all-zero tensor)."""
    return fp16_scales(x.abs().amax().reshape(1))[0]


class LowPrecisionAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) with moments stored in `state_dtype` (fp32, bf16 or fp16).

    `fused`: None uses the Triton kernel where it runs (CUDA), True requires it, False takes the
    multi-tensor torch implementation everywhere."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        state_dtype: torch.dtype = torch.float16,
        rounding: str = "stochastic",
        fused: bool | None = None,
    ) -> None:
        if state_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"state_dtype must be float32, bfloat16 or float16, got {state_dtype}")
        if rounding not in ("stochastic", "nearest"):
            raise ValueError(f"rounding must be 'stochastic' or 'nearest', got {rounding!r}")
        self.state_dtype, self.rounding, self.fused = state_dtype, rounding, fused
        self._kernels: dict[tuple[int, torch.device], FusedAdamWKernel] = {}
        self._noise, self._scratch = NoisePool(), Scratch()
        super().__init__(
            params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        )

    def uses_kernel(self, device: torch.device) -> bool:
        if self.fused is False:
            return False
        if self.fused is None:
            return device.type == "cuda" and triton_available(device)
        if not triton_available(device):
            raise ValueError(
                f"fused=True needs Triton on a CUDA device; the parameters are on {device}"
            )
        return True

    # --- state ------------------------------------------------------------------------------------

    def fresh_state(self, p: torch.Tensor) -> None:
        """Materialise `p`'s state as its first step would (step 0, zero moments)."""
        self.state.pop(p, None)
        self._init_state(p)

    def _init_state(self, p: torch.Tensor) -> dict[str, Any]:
        local = local_tensor(p)
        state = self.state[p]
        state["step"] = torch.zeros((), dtype=torch.float32, device=local.device)
        for key in STATE_KEYS:
            state[key] = torch.zeros_like(local, dtype=self.state_dtype)
            if self.state_dtype == torch.float16:
                state[key + "_scale"] = torch.ones((), dtype=torch.float32, device=local.device)
        return state

    def _decode(self, state: dict[str, Any], key: str) -> torch.Tensor:
        """One stored moment as FP32 (a new tensor)."""
        value = local_tensor(state[key]).float()
        if self.state_dtype == torch.float16:
            value = value / state[key + "_scale"]
            if key == "exp_avg_sq":
                value = value.square()  # stored as sqrt(v)
        return value

    def _encode(self, state: dict[str, Any], key: str, value: torch.Tensor) -> None:
        """Store an FP32 moment (nearest rounding: exact for values a decode produced)."""
        if self.state_dtype == torch.float16:
            if key == "exp_avg_sq":
                value = value.sqrt()
            scale = fp16_scale_for(value)
            state[key] = (value * scale).to(torch.float16)
            state[key + "_scale"] = scale
        else:
            state[key] = value.to(self.state_dtype)

    # --- the update -------------------------------------------------------------------------------

    def _group_tensors(self, group: dict[str, Any]) -> dict[torch.device, AdamWTensors]:
        """The group's parameters that have gradients, by device, with their states."""
        by_device: dict[torch.device, AdamWTensors] = {}
        fp16 = self.state_dtype == torch.float16
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p] if self.state.get(p) else self._init_state(p)
            param, grad = local_tensor(p), local_tensor(p.grad)
            if grad.dtype != torch.float32:
                grad = grad.float()
            ts = by_device.setdefault(param.device, AdamWTensors([], [], [], [], []))
            ts.params.append(param)
            ts.grads.append(grad.contiguous())
            ts.exp_avgs.append(local_tensor(state["exp_avg"]))
            ts.exp_avg_sqs.append(local_tensor(state["exp_avg_sq"]))
            ts.steps.append(state["step"])
            if fp16:
                ts.exp_avg_scales.append(state["exp_avg_scale"])
                ts.exp_avg_sq_scales.append(state["exp_avg_sq_scale"])
        return by_device

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "closures are not supported"
        for index, group in enumerate(self.param_groups):
            beta1, beta2 = group["betas"]
            hyper = AdamWHyper(
                group["lr"],
                group["weight_decay"],
                beta1,
                beta2,
                group["eps"],
                stochastic=self.rounding == "stochastic",
            )
            for device, ts in self._group_tensors(group).items():
                torch._foreach_add_(ts.steps, 1.0)
                if self.uses_kernel(device):
                    key = (index, device)
                    if key not in self._kernels:
                        from bigtrain.optim.adamw_kernel import FusedAdamWKernel

                        self._kernels[key] = FusedAdamWKernel()
                    self._kernels[key].step(ts, hyper)
                else:
                    torch_step(ts, hyper, self._noise, self._scratch)

    # --- checkpoints: always FP32 moments, like torch.optim.AdamW ------------------------------
    # Checkpoints hold decoded FP32 moments (DTensors for FSDP2 shards), so they load into any
    # state dtype and into torch's AdamW; decode/encode round-trips exactly (powers of two, and
    # values already representable), so a resumed run continues bit for bit.

    def decoded(self, state: dict[str, Any]) -> dict[str, Any]:
        """One parameter's state as torch's AdamW holds it: step and FP32 moments (new tensors,
        on the state's device: host copies decode on the host)."""
        out = {"step": state["step"].clone()}
        for key in STATE_KEYS:
            out[key] = self._decode(state, key)
        return out

    @torch.no_grad()
    def load_fp32(self, p: torch.Tensor, step: float, moments: dict[str, torch.Tensor]) -> None:
        """Set one parameter's state from FP32 moments, in place where it exists (DeepSpeed keeps
        views of a flat partition's state)."""
        state = self.state[p] if self.state.get(p) else self._init_state(p)
        state["step"].fill_(step)
        for key in STATE_KEYS:
            encoded: dict[str, torch.Tensor] = {}
            self._encode(encoded, key, moments[key].to(state[key].device, torch.float32))
            for name, value in encoded.items():
                local_tensor(state[name]).copy_(value)

    def state_dict(self) -> dict[str, Any]:
        saved = super().state_dict()
        params = [p for group in self.param_groups for p in group["params"]]
        for index, state in saved["state"].items():
            out = self.decoded(state)
            saved["state"][index] = {k: _like(params[index], v) for k, v in out.items()}
        return saved

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        for p, state in self.state.items():
            if not state:
                continue
            decoded = {k: local_tensor(state[k]).float() for k in STATE_KEYS}
            for k in STATE_KEYS:
                self._encode(state, k, decoded[k])
            step = state["step"]
            device = local_tensor(p).device
            state["step"] = (
                step.detach().to(device=device, dtype=torch.float32)
                if torch.is_tensor(step)
                else torch.tensor(float(step), device=device)
            )


def _like(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` as a DTensor sharded like `p` when p is one (what DCP needs to save shards); the
    0-dim step stays a plain tensor."""
    if hasattr(p, "device_mesh") and local.dim():
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(
            local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )
    return local
