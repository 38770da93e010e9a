"""Fault injection for drills and tests (`fault.*`, off by default)."""

from __future__ import annotations

from typing import Any

from bigtrain.config.schema import FaultConfig
from bigtrain.hooks import Callback


class FaultInjector(Callback):
    priority = 0  # before any monitor reads the gradients

    def __init__(self, cfg: FaultConfig, rank: int) -> None:
        self.cfg, self.active = cfg, rank == cfg.rank

    def on_after_backward(self, trainer, metrics: dict[str, Any]) -> None:
        if not self.active:
            return
        step = metrics["step"]
        named = trainer.backend.named_grads()
        for kind, steps, value in (
            ("nan_grad", self.cfg.nan_grad_step, float("nan")),
            ("inf_grad", self.cfg.inf_grad_step, float("inf")),
        ):
            if step in steps:
                name, grad = named[0]
                grad.view(-1)[0] = value
                trainer.event("fault", type=kind, tensor=name)
        if step in self.cfg.nan_loss_step:
            # A NaN loss poisons every gradient through backward; inject both.
            metrics["local_loss"] = metrics["local_loss"] * float("nan")
            for _, grad in named:
                grad.fill_(float("nan"))
            trainer.event("fault", type="nan_loss")
