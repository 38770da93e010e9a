"""INT8 calibration as a training callback: per-channel activation maxima folded each step (one
MAX all-reduce), smoothing switched on after `precision.int8.calibration_steps`, scales carried in
the trainer state."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from bigtrain.config.schema import Int8Config
from bigtrain.errors import ConfigError
from bigtrain.precision.int8 import Int8Layer
from bigtrain.train.hooks import Callback
from bigtrain.train.step import StepResult
from bigtrain.utils.names import canonical_name, compress_names
from bigtrain.utils.tensors import local_tensor


class OtherStage:
    """An INT8 layer another pipeline stage runs: its calibration vectors, whole, filled in by the
    MAX across ranks, so every rank holds (and a checkpoint saves) every layer's."""

    def __init__(self, in_features: int, device: torch.device) -> None:
        self.act_amax = torch.zeros(in_features, device=device)
        self.step_amax = torch.zeros(in_features, device=device)
        self.smoothing = self.observe = False


def held_layers(model: torch.nn.Module, built: dict[str, Int8Layer]) -> dict[str, Any]:
    """The INT8 layers as `model` (the backend's) runs them, by the names the build gave: a
    pipeline stage is a copy of its part of the model, and the layers of other stages are
    OtherStage holders."""
    live = {canonical_name(n): m for n, m in model.named_modules() if isinstance(m, Int8Layer)}
    if not live or live.keys() == built.keys():
        return {n: live.get(n, layer) for n, layer in built.items()}
    device = next(iter(live.values())).act_amax.device
    return {
        n: live[n] if n in live else OtherStage(layer.in_features, device)
        for n, layer in built.items()
    }


class Int8Calibration(Callback):
    """Folds each step's max |x| per input channel into the calibration (one MAX all-reduce over
    all layers at once, so every rank holds the same scales), switches smoothing on when
    `calibration_steps` are done, and carries the scales in the trainer state."""

    state_key = "int8"

    def __init__(self, layers: dict[str, Int8Layer], cfg: Int8Config) -> None:
        self.layers, self.cfg = layers, cfg
        self.steps = 0  # optimizer steps folded into the calibration
        self.smoothing_on = False  # whether the layers use the calibrated scales

    @property
    def calibrated(self) -> bool:
        return self.steps >= self.cfg.calibration_steps

    def on_start(self, trainer) -> None:
        # DeepSpeed casts buffers to the compute dtype: amax values stay FP32.
        for layer in self.layers.values():
            layer.act_amax = layer.act_amax.float()
            layer.step_amax = layer.step_amax.float()
        self._apply()

    def on_step_end(self, trainer, result: StepResult) -> None:
        if not self.cfg.calibration_steps:
            return
        if self.calibrated and self.cfg.calibration == "fixed":
            return
        layers = list(self.layers.values())
        # Whole vectors on every rank (replicated DTensors under tensor parallelism, whose
        # rowwise layers fill their own input columns: the MAX across ranks completes them).
        act_amax = [local_tensor(layer.act_amax) for layer in layers]
        step_amaxes = [local_tensor(layer.step_amax) for layer in layers]
        if not result.skipped:  # a skipped step's activations may be the anomaly's
            step_amax = torch.cat(step_amaxes)
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(step_amax, op=dist.ReduceOp.MAX)
            current = torch.cat(act_amax)
            if self.calibrated:  # EMA after calibration
                d = self.cfg.ema_decay
                folded = d * current + (1 - d) * step_amax
            else:
                folded = torch.maximum(current, step_amax)
            for amax, part in zip(act_amax, folded.split([len(a) for a in act_amax]), strict=True):
                amax.copy_(part)
            self.steps += 1
            if self.calibrated and not self.smoothing_on:
                trainer.event(
                    "int8_calibrated",
                    steps=self.steps,
                    mode=self.cfg.calibration,
                    layers=len(layers),
                )
        for amax in step_amaxes:
            amax.zero_()
        self._apply()

    def _apply(self) -> None:
        observe = not self.calibrated or self.cfg.calibration == "ema"
        on = self.calibrated and self.cfg.calibration_steps > 0
        for layer in self.layers.values():
            if isinstance(layer, OtherStage):
                continue
            layer.smoothing = on
            layer.observe = observe and self.cfg.calibration_steps > 0
        self.smoothing_on = on

    def state_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "act_amax": {
                n: local_tensor(layer.act_amax).float().tolist() for n, layer in self.layers.items()
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if set(state["act_amax"]) != set(self.layers):
            raise ConfigError(
                "the checkpoint's INT8 calibration covers other layers "
                f"({compress_names(sorted(state['act_amax']))}) than precision.int8 selects "
                f"({compress_names(sorted(self.layers))})"
            )
        self.steps = int(state["steps"])
        for name, layer in self.layers.items():
            # New FP32 tensors: DeepSpeed casts buffers to BF16, and a resume loads before on_start.
            device = layer.act_amax.device
            layer.act_amax = torch.tensor(
                state["act_amax"][name], dtype=torch.float32, device=device
            )
            layer.step_amax = torch.zeros_like(layer.act_amax)
        self._apply()
