"""Fault injection for drills and tests (`fault.*`, off by default)."""

from __future__ import annotations

from typing import Any

import torch

from bigtrain.config.schema import FaultConfig
from bigtrain.errors import ConfigError
from bigtrain.hooks import Callback


class FaultInjector(Callback):
    priority = 0  # before any monitor reads the gradients

    def __init__(self, cfg: FaultConfig, rank: int) -> None:
        self.cfg, self.active = cfg, rank == cfg.rank

    def _target(self, named: list[tuple[str, torch.Tensor]]) -> tuple[str, torch.Tensor]:
        """The gradient the drills poison: fault.grad_tensor, or the first one held here."""
        held = [(n, g) for n, g in named if g.numel()]
        if not self.cfg.grad_tensor:
            return held[0]
        for name, grad in held:
            if name == self.cfg.grad_tensor:
                return name, grad
        names = [n for n, _ in named]
        if self.cfg.grad_tensor in names:
            raise ConfigError(
                f"key 'fault.grad_tensor': rank {self.cfg.rank} holds no part of "
                f"{self.cfg.grad_tensor!r}; pick another fault.rank or tensor"
            )
        raise ConfigError(
            f"key 'fault.grad_tensor' got {self.cfg.grad_tensor!r}, expected a parameter name "
            f"such as {names[0]!r}"
        )

    @torch.no_grad()
    def on_after_backward(self, trainer, metrics: dict[str, Any]) -> None:
        if not self.active:
            return
        step, cfg = metrics["step"], self.cfg
        named = trainer.backend.named_grads()
        for kind, steps in (
            ("nan_grad", cfg.nan_grad_step),
            ("inf_grad", cfg.inf_grad_step),
            ("grad_spike", cfg.grad_spike_step),
        ):
            if step in steps:
                name, grad = self._target(named)
                if kind == "grad_spike":
                    grad.mul_(cfg.spike_factor)
                else:
                    grad.view(-1)[0] = float("nan") if kind == "nan_grad" else float("inf")
                trainer.event("fault", type=kind, tensor=name)
        if step in cfg.loss_spike_step:
            metrics["local_loss"] = metrics["local_loss"] * cfg.spike_factor
            trainer.event("fault", type="loss_spike", factor=cfg.spike_factor)
        if step in cfg.nan_loss_step:
            # A NaN loss poisons every gradient through backward; inject both.
            metrics["local_loss"] = metrics["local_loss"] * float("nan")
            for _, grad in named:
                grad.fill_(float("nan"))
            trainer.event("fault", type="nan_loss")
