"""Metric sinks (log.sinks: wandb, TensorBoard, MLflow) fed from the loop's hooks, on rank 0.

Every sink gets the same records in the same order (telemetry/sinks.py's protocol). Metric records
are held back for `log.hold_steps` steps: a rollback drops the held records of the steps it
abandons, so each sink's history is the trajectory the run kept, its steps increasing. Events are
sent at once, a rollback at the step it happened in (`from_step`); final.json's figures (the
`finish` event) become the sinks' summary."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from bigtrain.config.schema import LogConfig, ResilienceConfig, WandbConfig
from bigtrain.telemetry.mlflow_sink import MlflowSink, tracking_uri
from bigtrain.telemetry.sinks import (
    STEP_KEY,
    HeldRecords,
    MetricSink,
    SinkRun,
    flat_event,
    flat_figures,
    flat_record,
    require_packages,
)
from bigtrain.telemetry.tensorboard_sink import TensorBoardSink
from bigtrain.telemetry.wandb_sink import WandbSink
from bigtrain.train.hooks import Callback, close_each
from bigtrain.train.step import StepResult


def resolve_hold_steps(hold_steps: int | None, resilience: ResilienceConfig) -> int:
    """Steps a metric record waits before it is sent: `log.hold_steps`, by default enough for a
    rollback to the newest good snapshot (taken every `snapshot_every` steps, good after
    `confirm_steps` more)."""
    if hold_steps is not None:
        return hold_steps
    return resilience.snapshot_every + resilience.confirm_steps


def configured_sinks(log: LogConfig, wandb: WandbConfig) -> list[str]:
    """log.sinks, less wandb while wandb.mode is disabled (how wandb was switched off before
    log.sinks existed)."""
    return [s for s in log.sinks if not (s == "wandb" and wandb.mode == "disabled")]


def make_sinks(log: LogConfig, wandb: WandbConfig, out_dir: Path) -> list[MetricSink]:
    """The configured sinks of a run in `out_dir`, not yet started; ConfigError (exit 2) when a
    package is missing."""
    names = configured_sinks(log, wandb)
    require_packages(names, tracking_uri(out_dir))
    made: dict[str, MetricSink] = {}
    for name in names:
        if name == "wandb":
            made[name] = WandbSink(wandb)
        elif name == "tensorboard":
            made[name] = TensorBoardSink()
        else:
            made[name] = MlflowSink(log.mlflow_experiment)
    return list(made.values())


class SinkLogger(Callback):
    def __init__(self, sinks: list[MetricSink], hold_steps: int | None, config: dict) -> None:
        self.sinks, self.hold_steps_cfg, self.config = sinks, hold_steps, config
        self.active = False  # rank 0 after on_start: the sinks are open
        self.hold_steps = 0
        self.held = HeldRecords()
        self.early: list[dict[str, Any]] | None = []  # events before on_start (start, resume)

    def on_start(self, trainer) -> None:
        early, self.early = self.early or [], None
        if not trainer.env.is_main:
            return
        path = trainer.run_dir.path
        run = SinkRun(path, path.name, self.config, trainer.policy.to_dict(), trainer.step)
        for sink in self.sinks:
            sink.start(run)
        self.active = True
        self.hold_steps = resolve_hold_steps(self.hold_steps_cfg, trainer.cfg.resilience)
        if trainer.start_record is not None:  # the evaluation before a fresh run's first step
            self.held.add(flat_record(trainer.start_record))
        for record in early:  # setup's events (start, resume, ...), in order
            self.on_event(trainer, record)

    def on_step_end(self, trainer, result: StepResult) -> None:
        if not self.active:
            return
        record = result.record
        # A record of a step later than the trainer's is of the step a rollback has just undone.
        if record and record["step"] <= trainer.step:
            self.held.add(flat_record(record))
        self.send_until(trainer.step - self.hold_steps)
        if result.samples:
            for sink in self.sinks:
                sink.log_samples(trainer.step, result.samples)

    def send_until(self, step: float) -> None:
        """Send the held records of steps up to `step`, oldest first, to every sink."""
        for flat in self.held.due(step):
            data = {k: v for k, v in flat.items() if k != STEP_KEY}
            for sink in self.sinks:
                sink.log_record(flat[STEP_KEY], data)

    def on_event(self, trainer, record: dict[str, Any]) -> None:
        if self.early is not None:
            self.early.append(record)  # sent once the sinks are open
        if not self.active:
            return
        flat = flat_event(record)
        if record["kind"] == "rollback":
            flat["events/rollback/abandoned_sent"] = self.held.abandon_after(record["to_step"])
        for sink in self.sinks:  # at the step it happened (a rollback: the anomaly's step)
            sink.log_event(record["step"], record, flat)
        if record["kind"] == "finish":  # final.json's figures: the run's summary
            self.flush()
            figures = flat_figures(record)
            for sink in self.sinks:
                sink.log_summary(figures)

    def flush(self) -> None:
        """Send everything held: the run has ended or stopped, no rollback can come any more."""
        if self.active:
            self.send_until(math.inf)

    def on_finish(self, trainer) -> None:
        self.flush()

    def on_stop(self, trainer, reason: str) -> None:
        self.flush()

    def close(self) -> None:
        """Flush and close every sink, each on its own: one that fails (an MLflow store that
        cannot be written) leaves the others their records; the first error is raised after."""
        try:
            self.flush()
        finally:
            self.active = False
            close_each(self.sinks)  # each closes only what it opened
