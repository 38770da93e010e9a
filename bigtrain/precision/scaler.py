"""Dynamic (or static) loss scaling for FP16 compute on the torch backends (local, FSDP2).

The loss is multiplied by the scale before backward and the gradients divided by it before
clipping. The decision whether a step overflowed is the loop's, taken on numbers reduced over all
ranks, so every rank's scaler sees the same sequence of overflows and holds the same scale.

On ZeRO, DeepSpeed's own scaler runs instead, configured from the same settings (the `fp16`
block bigtrain generates), but its rules differ in detail: it grows after `growth_interval + 1`
clean steps, and after its first back-off it halves on every overflow until it has grown again.
With hysteresis 1 and before any growth both give the same scales; beyond that, FP16 runs on
ZeRO and on the torch backends follow different scale sequences (the skipped steps agree: an
overflow is skipped on every backend).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bigtrain.config.schema import PrecisionConfig


@dataclass
class ScaleUpdate:
    """What one step did to the scale: reported in metrics and events."""

    scale: float
    overflow: bool
    at_min: bool = False  # an overflow at the minimum scale: an anomaly, not another halving
    changed: str = ""  # "backoff", "growth" or ""


class LossScaler:
    def __init__(self, cfg: PrecisionConfig, dynamic: bool) -> None:
        self.dynamic = dynamic
        self.scale = float(cfg.loss_scale)
        self.growth_interval = cfg.loss_scale_growth_interval
        self.hysteresis = cfg.loss_scale_hysteresis
        self.min_scale = cfg.loss_scale_min
        self.clean_steps = 0
        self.overflows_left = self.hysteresis

    def update(self, overflow: bool) -> ScaleUpdate:
        if not self.dynamic:
            return ScaleUpdate(self.scale, overflow, at_min=overflow)
        if overflow:
            self.clean_steps = 0
            if self.scale <= self.min_scale:
                return ScaleUpdate(self.scale, True, at_min=True)
            self.overflows_left -= 1
            if self.overflows_left > 0:
                return ScaleUpdate(self.scale, True)
            self.overflows_left = self.hysteresis
            self.scale = max(self.scale / 2, self.min_scale)
            return ScaleUpdate(self.scale, True, changed="backoff")
        self.clean_steps += 1
        if self.clean_steps % self.growth_interval == 0:
            self.scale *= 2
            self.overflows_left = self.hysteresis
            return ScaleUpdate(self.scale, False, changed="growth")
        return ScaleUpdate(self.scale, False)

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "clean_steps": self.clean_steps,
            "overflows_left": self.overflows_left,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.overflows_left = int(state["overflows_left"])
