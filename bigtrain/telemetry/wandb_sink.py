"""The wandb sink: metrics at log steps, every event, text samples (a `samples` table), online,
offline (files under RUN_DIR/wandb) or disabled. The run id is kept in the run directory so a
restarted run continues the same wandb run.

wandb's own step only ever increases (a row logged at a lower step is dropped), so the training
step travels as the metric `train/step`, the x-axis of every chart, and rows are logged without
`step=`. The records come held (telemetry/sinks.py): wandb's history is the kept trajectory."""

from __future__ import annotations

import uuid
from typing import Any

from bigtrain.config.schema import WandbConfig
from bigtrain.telemetry.sinks import STEP_KEY, SinkRun

RUN_ID_FILE = "wandb_run_id"
ALERTS = ("rollback", "abort", "preempt")  # online runs also raise a wandb alert for these


class WandbSink:
    name = "wandb"

    def __init__(self, cfg: WandbConfig) -> None:
        self.cfg = cfg
        self.run = None

    def start(self, run: SinkRun) -> None:
        import wandb

        id_file = run.path / RUN_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:8]
        self.run = wandb.init(
            mode=self.cfg.mode,
            dir=str(run.path),
            project=self.cfg.project,
            entity=self.cfg.entity,
            name=self.cfg.name or run.name,
            group=self.cfg.group,
            tags=list(self.cfg.tags),
            notes=self.cfg.notes,
            config=run.config,
            id=run_id,
            resume="allow",
            # No history and summary tables on the console at the end: the run's own lines and
            # final.json say how it went (the tables stay in the wandb run).
            settings=wandb.Settings(quiet=True),
        )
        id_file.write_text(run_id + "\n")
        self.run.summary["precision"] = run.policy
        self.run.define_metric(STEP_KEY)
        self.run.define_metric("*", step_metric=STEP_KEY)

    def log_record(self, step: int, flat: dict[str, Any]) -> None:
        self.run.log({**flat, STEP_KEY: step})  # no step=: wandb's own step just counts rows

    def log_event(self, step: int, record: dict[str, Any], flat: dict[str, Any]) -> None:
        self.run.log({**flat, STEP_KEY: step})
        if record["kind"] in ALERTS and self.cfg.mode == "online":
            import wandb

            self.run.alert(
                title=f"bigtrain {record['kind']} at step {record['step']}",
                text=", ".join(f"{k}={v}" for k, v in {**flat, STEP_KEY: step}.items()),
                level=wandb.AlertLevel.WARN,
            )

    def log_samples(self, step: int, samples: list) -> None:
        """Text samples as a `samples` table, sent at once (like events)."""
        import wandb

        rows = [[step, s.prompt, s.text, s.stop] for s in samples]
        table = wandb.Table(columns=["step", "prompt", "text", "stop"], data=rows)
        self.run.log({"samples": table, STEP_KEY: step})

    def log_summary(self, figures: dict[str, Any]) -> None:
        for key, value in figures.items():
            self.run.summary[f"final/{key}"] = value

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
