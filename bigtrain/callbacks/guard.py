"""What follows a step the monitor found wrong. The loop already kept the update from being
applied where it had to; this writes the event, picks the action and decides whether the run goes
on. The action ladder: FP16 overflow -> back off the scale (not an anomaly); anomaly ->
`monitor.nonfinite` / `monitor.on_spike` (rollback, skip, warn or abort); too many in a row, or too
many rollbacks (callbacks/rollback.py) -> exit 3."""

from __future__ import annotations

from typing import NoReturn

from bigtrain.config.schema import MonitorConfig
from bigtrain.errors import AbortRun
from bigtrain.train.hooks import Callback
from bigtrain.train.step import StepResult


def abort(trainer, reason: str) -> NoReturn:
    """Stop with exit 3: the ABORTED marker (so a restarted run exits at once instead of looping
    under torchrun or SLURM), an `abort` event, AbortRun. Checkpoints stay as they are."""
    if trainer.env.is_main:
        trainer.run_dir.aborted_marker.write_text(reason + "\n")
    trainer.event("abort", reason=reason)
    raise AbortRun(reason)


class AnomalyGuard(Callback):
    priority = 1  # before rollback and checkpointing: a run that aborts here must not checkpoint

    def __init__(self, cfg: MonitorConfig) -> None:
        self.cfg = cfg
        self.consecutive = 0

    def on_step_end(self, trainer, result: StepResult) -> None:
        update = result.scale_update
        if result.overflow:
            trainer.event(
                "overflow", loss_scale=update.scale, scale_change=update.changed or "none"
            )
        anomaly = result.anomaly
        if anomaly is None:
            self.consecutive = 0
            return
        self.consecutive += 1
        trainer.state.anomalies += 1
        # Replicas that disagree are as wrong as a NaN: the same ladder (replay, roll back).
        action = self.cfg.on_spike if anomaly.kind == "spike" else self.cfg.nonfinite
        stop = None
        if action == "abort":
            what = "disagreeing replicas" if anomaly.kind == "replica" else "non-finite"
            stop = f"{what} {anomaly.metric} at step {trainer.step} (monitor.nonfinite=abort)"
        elif self.consecutive >= self.cfg.max_consecutive:
            stop = (
                f"{self.consecutive} anomalous steps in a row up to step {trainer.step} "
                f"(monitor.max_consecutive={self.cfg.max_consecutive})"
            )
        result.action = "abort" if stop else action
        trainer.event("anomaly", **anomaly.details(), action=result.action)
        if stop:
            abort(trainer, stop)
