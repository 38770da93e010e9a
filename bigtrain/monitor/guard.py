"""Non-finite loss or gradients: the loop already skipped the update; this decides what follows."""

from __future__ import annotations

from typing import Any

import torch

from bigtrain.errors import AbortRun
from bigtrain.hooks import Callback


class NonFiniteGuard(Callback):
    """`skip`: record the anomaly and go on. `abort`: record it, write the ABORTED marker (a
    restarted run then exits 3 at once instead of looping under torchrun or SLURM), exit 3."""

    priority = 1  # before checkpointing: a run that aborts at this step must not checkpoint it

    def __init__(self, action: str) -> None:
        self.action = action

    def on_step_end(self, trainer, metrics: dict[str, Any]) -> None:
        if metrics["finite"]:
            return
        update = metrics.get("scale_update")
        if update is not None and bool(torch.isfinite(metrics["loss"])) and not update.at_min:
            # FP16 overflow under loss scaling: the step is skipped and the scale backs off. Normal,
            # counted in skipped_steps, and never silent.
            trainer.event(
                "overflow", loss_scale=update.scale, scale_change=update.changed or "none"
            )
            return
        trainer.state.anomalies += 1
        loss, norm = metrics["loss"].item(), metrics["grad_norm"].item()
        metric = "loss" if loss != loss or abs(loss) == float("inf") else "grad_norm"
        if update is not None and update.at_min:
            metric = "loss_scale_at_minimum"
        trainer.event(
            "anomaly",
            type="nonfinite",
            metric=metric,
            loss=loss,
            grad_norm=norm,
            action=self.action,
        )
        if self.action == "abort":
            reason = f"non-finite {metric} at step {trainer.step} (monitor.nonfinite=abort)"
            if trainer.env.is_main:
                trainer.run_dir.aborted_marker.write_text(reason + "\n")
            trainer.event("abort", reason=reason)
            raise AbortRun(reason)
