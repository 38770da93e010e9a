"""Fault injection for drills and tests (`drill.*`, off by default)."""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import torch

from bigtrain.config.schema import DrillConfig
from bigtrain.errors import ConfigError
from bigtrain.model.hf_routers import routed_experts_of, routing_layers
from bigtrain.train.hooks import Callback
from bigtrain.train.step import StepResult
from bigtrain.utils.names import canonical_name
from bigtrain.utils.tensors import local_tensor

FIRST_RUN_ONLY = ("transient_nan", "grad_spike", "bitflip")
"""Drills of silent data corruption: a replay of their step comes out clean."""
TOP_EXPONENT_BIT = {8: 62, 4: 30, 2: 14}  # by bytes per value: FP64, FP32, BF16/FP16
INTS = {8: torch.int64, 4: torch.int32, 2: torch.int16}


def flip_bit(tensor: torch.Tensor, index: int, bit: int) -> tuple[float, float]:
    """Flip `bit` (-1: the highest exponent bit) of value `index` of a contiguous tensor, in
    place; its value before and after."""
    size = tensor.element_size()
    bit = TOP_EXPONENT_BIT[size] if bit < 0 else bit
    mask = 1 << bit
    if mask >= 1 << (8 * size - 1):  # the sign bit: the signed integer's lowest value
        mask -= 1 << (8 * size)
    value = tensor.view(-1)[index : index + 1]
    before = value.item()
    value.view(INTS[size]).bitwise_xor_(mask)
    return before, value.item()


class Drills(Callback):
    def __init__(self, cfg: DrillConfig, rank: int, group: int = 0) -> None:
        """`group`: this process's replica group (0 without fault tolerance)."""
        self.cfg, self.rank = cfg, rank
        self.active = rank == cfg.rank and group == cfg.group
        self.in_group = group == cfg.group  # the group-wide drills (slow, jitter)
        self.kills_group = group == cfg.kill_group
        self.diverges = group == cfg.diverge_group and rank == 0
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
        """The gradient the drills poison: drill.grad_tensor, or the first one held here."""
        held = [(n, g) for n, g in named if g.numel()]
        if not self.cfg.grad_tensor:
            return held[0]
        for name, grad in held:
            if name == self.cfg.grad_tensor:
                return name, grad
        names = [n for n, _ in named]
        if self.cfg.grad_tensor in names:
            raise ConfigError(
                f"key 'drill.grad_tensor': rank {self.cfg.rank} holds no part of "
                f"{self.cfg.grad_tensor!r}; pick another drill.rank or tensor"
            )
        raise ConfigError(
            f"key 'drill.grad_tensor' got {self.cfg.grad_tensor!r}, expected a parameter name "
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

    def _fp8_drills(self, trainer, step: int) -> None:
        """The FP8 drills on `drill.fp8_layer` for this step (first run and replay)."""
        cfg = self.cfg
        if not self.active or (not cfg.fp8_amax_step and cfg.fp8_outlier_from < 0):
            return
        layers = trainer.setup.fp8_layers
        if not layers:
            raise ConfigError(
                "key 'drill.fp8_amax_step'/'drill.fp8_outlier_from': the model has no FP8 "
                "layer (precision.fp8.enabled=true)"
            )
        name = cfg.fp8_layer or next(iter(layers))
        if name not in layers:
            raise ConfigError(
                f"key 'drill.fp8_layer' got {name!r}, expected an FP8 layer that rank "
                f"{self.rank} runs, such as {next(iter(layers))!r}"
            )
        layer = layers[name]
        layer.drill_amax = cfg.fp8_amax if step in cfg.fp8_amax_step else None
        outlier = 0 <= cfg.fp8_outlier_from <= step
        layer.drill_outlier = cfg.fp8_outlier_factor if outlier else 0.0
        if not trainer.replaying and (step in cfg.fp8_amax_step or step == cfg.fp8_outlier_from):
            kind = "fp8_amax" if step in cfg.fp8_amax_step else "fp8_outlier"
            trainer.event("fault", type=kind, layer=name)

    def on_before_forward(self, trainer, step: int) -> None:
        """The router-bias drill: on for the forwards of its steps (first run and replay); the
        activation bit flip, armed for the first run's forward."""
        self._arm_activation_flip(trainer, step)
        self._fp8_drills(trainer, step)
        expert = self.cfg.router_bias
        if not self.active or expert < 0:
            return
        if not trainer.replaying:
            self.biased = self._due("router_bias", self.cfg.router_bias_step, step)
        layers = routing_layers(trainer.backend.model)  # bigtrain's MoE, a family's probes
        if self.biased and not layers:
            raise ConfigError(
                "key 'drill.router_bias': the model has no MoE layer (model.moe, or a "
                "transformers MoE family)"
            )
        for layer in layers:
            experts = routed_experts_of(layer)
            if expert >= experts:
                raise ConfigError(
                    f"key 'drill.router_bias' ({expert}) must be an expert index below "
                    f"the experts of an MoE layer ({experts})"
                )
            bias = torch.zeros(experts, device=layer.stats.device)
            bias[expert] = self.cfg.router_bias_logit
            layer.router_bias = bias if self.biased else None
        if self.biased and not trainer.replaying:
            trainer.event("fault", type="router_bias", expert=expert)

    def _arm_activation_flip(self, trainer, step: int) -> None:
        """The activation bit-flip drill: one value of the named module's output in the step's
        first forward (not in its replay)."""
        name = self.cfg.bitflip_activation
        if not (self.active and name) or trainer.replaying:
            return
        if not self._due("bitflip", self.cfg.bitflip_step, step):
            return
        modules = {canonical_name(n): m for n, m in trainer.backend.model.named_modules()}
        if name not in modules:
            raise ConfigError(
                f"key 'drill.bitflip_activation' got {name!r}, expected a module name such as "
                f"{next(n for n in modules if n)!r}"
            )

        def flip_output(module, inputs, output):
            handle.remove()
            out = (output[0] if isinstance(output, tuple) else output).clone()
            with torch.no_grad():
                index = self._index(out, step)
                before, after = flip_bit(out, index, self.cfg.bitflip_bit)
            trainer.event(
                "fault", type="bitflip", module=name, index=index, before=before, after=after
            )
            return (out, *output[1:]) if isinstance(output, tuple) else out

        handle = modules[name].register_forward_hook(flip_output)

    def _index(self, tensor: torch.Tensor, step: int) -> int:
        index = self.cfg.bitflip_index
        return index if index >= 0 else random.Random(step).randrange(tensor.numel())

    @torch.no_grad()
    def on_after_backward(self, trainer, result: StepResult) -> None:
        if self.in_group and self.rank == self.cfg.slow_rank and self.cfg.slow_s > 0:
            time.sleep(self.cfg.slow_s)  # a straggler: this rank's forward+backward is slower
        if self.kills_group:
            self._kill_group(trainer, result.step)
        if not self.active:
            return
        step, cfg = result.step, self.cfg
        if trainer.replaying:
            # A replay of the step meets the same data faults again; a transient one is gone.
            kinds = [k for k in self.this_step if k not in FIRST_RUN_ONLY]
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
            ("data_spike", cfg.data_spike_step),
            ("bitflip", [] if cfg.bitflip_activation else cfg.bitflip_step),
            ("transient_nan", cfg.transient_nan_step),
            ("spike", cfg.spike_step),
            ("loss_spike", cfg.loss_spike_step),
            ("nan_loss", cfg.nan_loss_step),
        ]

    def _apply(self, kind: str, trainer, result: StepResult, named) -> None:
        factor = self.cfg.spike_factor
        if kind == "bitflip":
            name, grad = self._target(named)
            index = self._index(grad, result.step)
            before, after = flip_bit(grad, index, self.cfg.bitflip_bit)
            trainer.event("fault", type=kind, tensor=name, index=index, before=before, after=after)
        elif kind in ("nan_grad", "inf_grad", "grad_spike", "data_spike", "transient_nan"):
            name, grad = self._target(named)
            if kind in ("grad_spike", "data_spike"):
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
        step = result.step
        if self.in_group and self.cfg.jitter_s > 0:
            # A noisy neighbour: late for the next quorum by a draw every rank of the group shares.
            draw = random.Random(f"{trainer.cfg.train.seed}:jitter:{step}").random()
            time.sleep(draw * self.cfg.jitter_s)
        if self.diverges and step in (self.cfg.diverge_step or [trainer.end_step]):
            before, after = flip_bit(
                local_tensor(trainer.backend.master_state()[0][0]).detach(), 0, 0
            )
            trainer.event("fault", type="diverge", before=before, after=after)
        if not self.active:
            return
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
