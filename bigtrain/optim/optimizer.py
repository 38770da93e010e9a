"""The AdamW optimizer a backend steps with, and its state in the form checkpoints hold: torch's
AdamW for FP32 states, bigtrain's (optim/adamw.py) for BF16/FP16 states, math in FP32; the
per-parameter state created eagerly, read and written as FP32 moments by canonical name."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from bigtrain.config.schema import OptimConfig
from bigtrain.errors import ConfigError
from bigtrain.optim.adamw import LowPrecisionAdamW
from bigtrain.precision.policy import PrecisionPolicy, dtype_name
from bigtrain.utils.tensors import full_shape, local_tensor
from bigtrain.utils.triton import triton_available

MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's moments, in checkpoints always FP32


def adamw_param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices (linear weights, embeddings), not biases or norm gains."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if len(full_shape(p)) >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def make_adamw(
    params: list[dict],
    optim: OptimConfig,
    policy: PrecisionPolicy,
    device: torch.device,
    rounding: str = "stochastic",
) -> torch.optim.Optimizer:
    """torch's AdamW for FP32 states, bigtrain's for BF16/FP16 states (math in FP32; BF16 states
    rounded as precision.optimizer_state_rounding says); fused per optim.fused (by default on
    CUDA)."""
    fused = device.type == "cuda" if optim.fused is None else optim.fused
    if policy.optimizer_state_dtype != torch.float32:
        if fused and not triton_available(device):
            raise ConfigError(
                f"key 'optim.fused' is true, but bigtrain's fused AdamW for "
                f"{dtype_name(policy.optimizer_state_dtype)} states is a Triton kernel, which "
                f"cannot run on {device}; leave it null (fused on CUDA) or set false"
            )
        return LowPrecisionAdamW(
            params,
            lr=optim.lr,
            betas=(optim.beta1, optim.beta2),
            eps=optim.eps,
            state_dtype=policy.optimizer_state_dtype,
            rounding=rounding,
            fused=fused,
        )
    return torch.optim.AdamW(
        params,
        lr=optim.lr,
        betas=(optim.beta1, optim.beta2),
        eps=optim.eps,
        fused=fused,
        foreach=None if fused else True,
    )


def fp32_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict:
    """One parameter's optimizer state as checkpoints hold it (FP32 moments)."""
    return optimizer.decoded(state) if isinstance(optimizer, LowPrecisionAdamW) else state


def fp32_moments(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> dict | None:
    """`param`'s AdamW moments where the optimizer holds them in FP32 (local tensors a
    checkpoint load can read into in place); None where it holds none, or in another dtype."""
    state = optimizer.state.get(param)
    if isinstance(optimizer, LowPrecisionAdamW) or not state or not set(MOMENTS) <= set(state):
        return None
    moments = {k: local_tensor(state[k]) for k in MOMENTS}
    local = local_tensor(param)
    fits = all(m.dtype == torch.float32 and m.shape == local.shape for m in moments.values())
    return moments if fits else None


@torch.no_grad()
def set_fp32_optimizer_state(
    optimizer: torch.optim.Optimizer, param: torch.Tensor, step: float, moments: dict
) -> None:
    """Write one parameter's AdamW state from FP32 moments (a checkpoint's form), in place where
    it exists, creating it as the optimizer would otherwise."""
    if isinstance(optimizer, LowPrecisionAdamW):
        optimizer.load_fp32(param, step, moments)
        return
    if not optimizer.state.get(param):
        fresh_optimizer_state(optimizer, param)  # a new dict: read it after
    state = optimizer.state[param]
    state["step"].fill_(step)
    for key, value in moments.items():
        local_tensor(state[key]).copy_(value)


@torch.no_grad()
def fresh_optimizer_state(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> None:
    """AdamW's state of a parameter before its first step, materialised as the optimizer itself
    creates it (step 0, zero moments), so the first update is bit for bit the same. An optimizer
    never holds *no* state: DCP's get_state_dict fills a stateless one by running a zero-lr step,
    which leaves step 1 behind and shifts every later bias correction (FSDP2 diverged from local
    after a rollback to the starting state, whose checkpoint was written right after it)."""
    optimizer.state.pop(param, None)
    if isinstance(optimizer, LowPrecisionAdamW):
        optimizer.fresh_state(param)
        return
    on_device = optimizer.defaults.get("fused") or optimizer.defaults.get("capturable")
    state = optimizer.state[param]
    device = param.device if on_device else torch.device("cpu")
    state["step"] = torch.zeros((), dtype=torch.float32, device=device)
    for key in MOMENTS:
        state[key] = torch.zeros_like(param, memory_format=torch.preserve_format)
