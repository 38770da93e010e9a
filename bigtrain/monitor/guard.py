"""What follows a step the monitor found wrong. The loop already skipped the update where it had to;
this writes the event and decides whether the run goes on."""

from __future__ import annotations

from typing import Any

from bigtrain.config.schema import MonitorConfig
from bigtrain.errors import AbortRun
from bigtrain.hooks import Callback


class AnomalyGuard(Callback):
    """FP16 overflow: an `overflow` event, nothing more (the scale backed off). Anomaly: an
    `anomaly` event naming the metric and the tensors; then stop with exit 3 (ABORTED marker, so a
    restarted run exits at once instead of looping under torchrun or SLURM) when it is non-finite
    under `monitor.nonfinite=abort`, or after `monitor.max_consecutive` anomalous steps in a row."""

    priority = 1  # before checkpointing: a run that aborts at this step must not checkpoint it

    def __init__(self, cfg: MonitorConfig) -> None:
        self.cfg = cfg
        self.consecutive = 0

    def on_step_end(self, trainer, metrics: dict[str, Any]) -> None:
        update = metrics.get("scale_update")
        if metrics.get("overflow"):
            trainer.event(
                "overflow", loss_scale=update.scale, scale_change=update.changed or "none"
            )
        anomaly = metrics.get("anomaly")
        if anomaly is None:
            self.consecutive = 0
            return
        self.consecutive += 1
        trainer.state.anomalies += 1
        action = "skip" if metrics["skipped"] else "warn"
        stop = None
        if anomaly.kind == "nonfinite" and self.cfg.nonfinite == "abort":
            stop = f"non-finite {anomaly.metric} at step {trainer.step} (monitor.nonfinite=abort)"
        elif self.consecutive >= self.cfg.max_consecutive:
            stop = (
                f"{self.consecutive} anomalous steps in a row up to step {trainer.step} "
                f"(monitor.max_consecutive={self.cfg.max_consecutive})"
            )
        trainer.event("anomaly", **anomaly.details(), action="abort" if stop else action)
        if stop:
            if trainer.env.is_main:
                trainer.run_dir.aborted_marker.write_text(stop + "\n")
            trainer.event("abort", reason=stop)
            raise AbortRun(stop)
