"""Fault injection for drills and tests (`fault.*`, off by default)."""

from __future__ import annotations

import os
import signal
import threading
import time

import torch

from bigtrain.config.schema import FaultConfig
from bigtrain.errors import ConfigError
from bigtrain.model.moe import moe_layers
from bigtrain.train.hooks import Callback
from bigtrain.train.step import StepResult


class FaultInjector(Callback):
    def __init__(self, cfg: FaultConfig, rank: int, group: int = 0) -> None:
        """`group`: this process's replica group (0 without fault tolerance)."""
        self.cfg, self.rank = cfg, rank
        self.active = rank == cfg.rank and group == cfg.group
        self.kills_group = group == cfg.kill_group
        self.group_armed: set[int] = set()  # kill_group's steps not done in this run directory
        self.fired: set[tuple[str, int]] = set()  # a rollback repeats step numbers: fire once
        self.this_step: list[str] = []  # what fired in this step's first run (for its replay)
        self.biased = False  # the router-bias drill is on in this step (and its replay)

    def _due(self, kind: str, steps: list[int], step: int) -> bool:
        if step not in steps or (kind, step) in self.fired:
            return False
        self.fired.add((kind, step))
        return True

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

    def on_start(self, trainer) -> None:
        if self.kills_group:  # decided once by every rank of the group: all die, or none
            self.group_armed = {
                s for s in self.cfg.kill_step if not self._group_marker(trainer, s).exists()
            }

    @staticmethod
    def _group_marker(trainer, step: int):
        return (
            trainer.run_dir.path / f".fault-killed-group{trainer.setup.layout.ft_group}-step-{step}"
        )

    def _kill_group(self, trainer, step: int) -> None:
        """Every process of the group dies at once, inside the step (a lost node)."""
        if step not in self.group_armed:
            return
        if trainer.env.is_main:
            self._group_marker(trainer, step).write_text("")
            trainer.event("fault", type="kill_group", group=trainer.setup.layout.ft_group)
        os.kill(os.getpid(), signal.SIGKILL)

    def on_before_forward(self, trainer, step: int) -> None:
        """The router-bias drill: on for the forwards of its steps (first run and replay)."""
        expert = self.cfg.router_bias
        if not self.active or expert < 0:
            return
        if not trainer.replaying:
            self.biased = self._due("router_bias", self.cfg.router_bias_step, step)
        layers = moe_layers(trainer.backend.model)
        if self.biased and not layers:
            raise ConfigError("key 'fault.router_bias': the model has no MoE layer (model.moe)")
        for layer in layers:
            if expert >= layer.cfg.experts:
                raise ConfigError(
                    f"key 'fault.router_bias' ({expert}) must be an expert index below "
                    f"model.moe.experts ({layer.cfg.experts})"
                )
            bias = torch.zeros(layer.cfg.experts, device=layer.stats.device)
            bias[expert] = self.cfg.router_bias_logit
            layer.router_bias = bias if self.biased else None
        if self.biased and not trainer.replaying:
            trainer.event("fault", type="router_bias", expert=expert)

    @torch.no_grad()
    def on_after_backward(self, trainer, result: StepResult) -> None:
        if self.rank == self.cfg.slow_rank and self.cfg.slow_s > 0:
            time.sleep(self.cfg.slow_s)  # a straggler: this rank's forward+backward is slower
        if self.kills_group:
            self._kill_group(trainer, result.step)
        if not self.active:
            return
        step, cfg = result.step, self.cfg
        if trainer.replaying:
            # A replay of the step meets the same data faults again; a transient one is gone.
            kinds = [k for k in self.this_step if k != "transient_nan"]
        else:
            kinds = [k for k, steps in self._schedule() if self._due(k, steps, step)]
            self.this_step = kinds
        named = trainer.backend.named_grads() if kinds else []
        for kind in kinds:
            self._apply(kind, trainer, result, named)
        if self._once_per_run_dir(trainer, "hang", cfg.hang_step, step):
            trainer.event("fault", type="hang")
            threading.Event().wait()  # forever; the hang watchdog ends the process

    def _schedule(self) -> list[tuple[str, list[int]]]:
        cfg = self.cfg
        return [
            ("nan_grad", cfg.nan_grad_step),
            ("inf_grad", cfg.inf_grad_step),
            ("grad_spike", cfg.grad_spike_step),
            ("transient_nan", cfg.transient_nan_step),
            ("spike", cfg.spike_step),
            ("loss_spike", cfg.loss_spike_step),
            ("nan_loss", cfg.nan_loss_step),
        ]

    def _apply(self, kind: str, trainer, result: StepResult, named) -> None:
        factor = self.cfg.spike_factor
        if kind in ("nan_grad", "inf_grad", "grad_spike", "transient_nan"):
            name, grad = self._target(named)
            if kind == "grad_spike":
                grad.mul_(factor)
            else:
                grad.view(-1)[0] = float("inf") if kind == "inf_grad" else float("nan")
            trainer.event("fault", type=kind, tensor=name)
        elif kind == "spike":  # a loss spike with the gradients that come with it
            result.local_loss = result.local_loss * factor
            for _, grad in named:
                grad.mul_(factor)
            trainer.event("fault", type="spike", factor=factor)
        elif kind == "loss_spike":
            result.local_loss = result.local_loss * factor
            trainer.event("fault", type="loss_spike", factor=factor)
        elif kind == "nan_loss":
            # A NaN loss poisons every gradient through backward; inject both.
            result.local_loss = result.local_loss * float("nan")
            for _, grad in named:
                grad.fill_(float("nan"))
            trainer.event("fault", type="nan_loss")

    def on_step_end(self, trainer, result: StepResult) -> None:
        if not self.active:
            return
        step = result.step
        if self._due("sigterm", self.cfg.sigterm_step, step):
            trainer.event("fault", type="sigterm")
            os.kill(os.getpid(), signal.SIGTERM)
        if self.cfg.kill_group < 0 and self._once_per_run_dir(
            trainer, "killed", self.cfg.kill_step, step
        ):
            trainer.event("fault", type="kill")
            os.kill(os.getpid(), signal.SIGKILL)

    @staticmethod
    def _once_per_run_dir(trainer, kind: str, steps: list[int], step: int) -> bool:
        """Due at `step`, once per run directory: the restarted (requeued) run goes on."""
        marker = trainer.run_dir.path / f".fault-{kind}-step-{step}"
        if step not in steps or marker.exists():
            return False
        marker.write_text("")
        return True
