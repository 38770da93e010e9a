"""What the local and FSDP2 backends share: a torch optimizer over the model's (possibly sharded)
FP32 parameters, autocast in the current phase's dtype, FP32 islands, loss scaling for FP16."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from bigtrain.checkpoint.state import Block
from bigtrain.config.schema import OptimConfig, PrecisionConfig
from bigtrain.model.loss import lm_loss
from bigtrain.model.moe import aux_grad_scale
from bigtrain.optim.optimizer import (
    MOMENTS,
    adamw_param_groups,
    fresh_optimizer_state,
    make_adamw,
    set_fp32_optimizer_state,
)
from bigtrain.parallel.backends.base import Backend, load_buffers, scale_to_norm
from bigtrain.precision.islands import FP32Islands
from bigtrain.precision.policy import Phase, PrecisionPolicy
from bigtrain.precision.scaler import LossScaler, ScaleUpdate
from bigtrain.utils.names import canonical_name
from bigtrain.utils.tensors import local_block, local_tensor


class TorchBackend(Backend):
    """What local and FSDP2 share: a torch optimizer over the model's (possibly sharded) FP32
    parameters, autocast in the current phase's dtype, FP32 islands, loss scaling for FP16, and
    torch.distributed reductions."""

    name = "torch"
    uses_autocast = True

    def __init__(
        self,
        model: nn.Module,
        policy: PrecisionPolicy,
        optim: OptimConfig,
        precision: PrecisionConfig,
        device: torch.device,
    ) -> None:
        self.model, self.policy, self.device = model, policy, device
        groups = adamw_param_groups(model, optim.weight_decay)
        rounding = precision.optimizer_state_rounding
        self.optimizer = make_adamw(groups, optim, policy, device, rounding)
        self.scaler = (
            LossScaler(precision, policy.loss_scaling == "dynamic")
            if policy.loss_scaling != "none"
            else None
        )
        for p in self._params():  # materialised now: see fresh_optimizer_state
            fresh_optimizer_state(self.optimizer, p)
        # Canonical names in the optimizer's order, read now: while a schedule of several
        # pipeline chunks runs, FSDP2 may show a chunk's unsharded parameters in their place.
        names = {id(p): canonical_name(n) for n, p in model.named_parameters()}
        self._names = [names[id(p)] for p in self._params()]
        self.islands = FP32Islands(model, device.type, self.islands_whole())
        for phase in policy.phases:  # a later phase's misspelt pattern fails now, not at its switch
            self.islands.check(phase.fp32_modules)
        self.set_phase(policy.phases[0])

    def islands_whole(self) -> nn.Module | None:
        """The model an FP32 module pattern must match somewhere (None: `model` itself)."""
        return None

    def set_phase(self, phase: Phase) -> None:
        """Compute dtype and FP32 modules of a precision phase, effective from the next forward."""
        self.compute_dtype = phase.compute_dtype
        self.islands.set(phase.fp32_modules)

    def autocast(self) -> torch.autocast:
        enabled = self.uses_autocast and self.compute_dtype != torch.float32
        return torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=enabled)

    def forward_backward(
        self, inputs: torch.Tensor, targets: torch.Tensor, micro_step: int, num_micro_steps: int
    ) -> torch.Tensor:
        self.before_backward(micro_step == num_micro_steps - 1)
        factor = (self.scaler.scale if self.scaler else 1.0) / num_micro_steps
        with aux_grad_scale(self.model, factor):  # the MoE losses' gradient: the loss's
            with self.autocast():
                logits = self.model(inputs)
            with self.loss_context():
                loss = lm_loss(logits, self.layout.own_tokens(targets))
                (loss * factor).backward()
        return local_tensor(loss.detach())  # the same value on every tp rank

    def loss_scale(self) -> float | None:
        return self.scaler.scale if self.scaler else None

    def adopt_loss_scale(self, scale: float) -> None:
        if self.scaler is not None:
            self.scaler.scale = scale

    def update_loss_scale(self, overflow: bool) -> ScaleUpdate | None:
        return self.scaler.update(overflow) if self.scaler else None

    def before_backward(self, last_micro_step: bool) -> None:
        """FSDP2 syncs gradients on the last micro-batch only."""

    def eval_logits(self, inputs: torch.Tensor) -> torch.Tensor:
        self.model.eval()
        try:
            with self.autocast():
                return self.model(inputs)
        finally:
            self.model.train()

    def named_grads(self) -> list[tuple[str, torch.Tensor]]:
        empty = torch.empty(0, device=self.device)
        return [
            (canonical_name(n), local_tensor(p.grad) if p.grad is not None else empty)
            for n, p in self.model.named_parameters()
            if p.requires_grad
        ]

    def unscale_grads(self) -> float:
        if self.scaler and self.scaler.scale != 1.0:  # clip, check and log the true gradients
            torch._foreach_mul_(self._local_grads(), 1.0 / self.scaler.scale)
        return 1.0

    def _local_grads(self) -> list[torch.Tensor]:
        """This rank's gradient shards as plain tensors: scaled in place with one foreach call,
        also where the DTensors live on different meshes (tensor parallel and FSDP2 axes)."""
        return [local_tensor(p.grad) for p in self._params() if p.grad is not None]

    def clip_grads(self, max_norm: float, total_norm: torch.Tensor) -> None:
        if max_norm > 0:
            scale_to_norm(self._local_grads(), max_norm, total_norm.to(self.device))

    def step(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def skip_step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    @torch.no_grad()
    def load_from(self, source: Any, optimizer: bool) -> None:
        named = [(canonical_name(n), p) for n, p in self.model.named_parameters()]
        source.check_covers({name: tuple(p.shape) for name, p in named})
        for name, p in named:
            offset, shape = local_block(p)
            local_tensor(p).copy_(source.block(name, "param", offset, shape))
            if optimizer and p.requires_grad and source.step(name):
                moments = {k: source.block(name, k, offset, shape) for k in MOMENTS}
                set_fp32_optimizer_state(self.optimizer, p, source.step(name), moments)
            elif p.requires_grad:
                fresh_optimizer_state(self.optimizer, p)
        load_buffers(self.model, source)

    def master_state(self) -> tuple[list[torch.Tensor], dict]:
        return self._params(), self.optimizer.state

    def blocks(self, index: int, tensor: torch.Tensor) -> list[Block]:
        p = self._params()[index]
        offset, shape = local_block(p)
        return [(self._names[index], tuple(p.shape), offset, tensor.view(shape))]

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return {
            canonical_name(n): tuple(p.shape)
            for n, p in self.model.named_parameters()
            if p.requires_grad
        }

    def reset_optimizer_state(self, master: torch.Tensor) -> None:
        fresh_optimizer_state(self.optimizer, master)
