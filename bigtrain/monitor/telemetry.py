"""Per-tensor gradient norm and max |g| every `monitor.every` steps, before clipping."""

from __future__ import annotations

from typing import Any

import torch

from bigtrain.hooks import Callback


class GradTelemetry(Callback):
    priority = 20

    def __init__(self, every: int) -> None:
        self.every = every

    def on_after_backward(self, trainer, metrics: dict[str, Any]) -> None:
        if self.every <= 0 or metrics["step"] % self.every:
            return
        names, grads = zip(*trainer.backend.named_grads(), strict=True)
        norms = torch.stack(torch._foreach_norm(grads, 2))
        maxes = torch.stack(torch._foreach_norm(grads, float("inf")))
        # Expensive device-to-host synchronization, on telemetry steps only.
        metrics["grad_norms"] = dict(zip(names, norms.tolist(), strict=True))
        metrics["grad_max"] = dict(zip(names, maxes.tolist(), strict=True))
