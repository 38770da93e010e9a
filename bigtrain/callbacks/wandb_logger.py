"""wandb: metrics at log steps, every event and text samples (a `samples` table), online, offline
(files under out_dir/wandb) or disabled. The run id is kept in the run directory so a restarted
run continues the same wandb run.

wandb's own step only ever increases (a row logged at a lower step is dropped), and its history
cannot be rewritten offline, so the training step travels as the metric `train/step`, the x-axis of
every chart. Metric records are held back for `wandb.hold_steps` steps: a rollback drops the held
records of the steps it abandons, so the history keeps the trajectory the run kept. Events are sent
at once, a rollback at the step it happened in (`from_step`)."""

from __future__ import annotations

import math
import uuid
from array import array
from bisect import bisect_right
from collections import deque
from typing import Any

from bigtrain.callbacks.metrics import START_RECORD
from bigtrain.config.schema import ResilienceConfig, WandbConfig
from bigtrain.train.hooks import Callback
from bigtrain.train.step import StepResult

RUN_ID_FILE = "wandb_run_id"
ALERTS = ("rollback", "abort", "preempt")  # online runs also raise a wandb alert for these
STEP_KEY = "train/step"  # the training step: the x-axis of every wandb chart
PER_SOURCE = ("tokens_by_source",)  # dicts by mixture source name, not by layer


def resolve_hold_steps(cfg: WandbConfig, resilience: ResilienceConfig) -> int:
    """Steps a metric record waits before it is sent: `wandb.hold_steps`, by default enough for a
    rollback to the newest good snapshot (taken every `snapshot_every` steps, good after
    `confirm_steps` more)."""
    if cfg.hold_steps is not None:
        return cfg.hold_steps
    return resilience.snapshot_every + resilience.confirm_steps


class WandbLogger(Callback):
    priority = 90

    def __init__(self, cfg: WandbConfig, config_dict: dict[str, Any]) -> None:
        self.cfg, self.config_dict = cfg, config_dict
        self.run = None
        self.hold_steps = 0
        self.held: deque[dict[str, Any]] = deque()  # wandb records not yet sent, by step
        self.sent_steps = array("q")  # steps of the records sent, ascending
        self.early: list[dict[str, Any]] | None = []  # events before on_start (start, resume)

    def on_start(self, trainer) -> None:
        early, self.early = self.early or [], None
        if not trainer.env.is_main:
            return
        self.run = self._init_run(trainer)
        self.run.summary["precision"] = trainer.context["policy"].to_dict()
        self.run.define_metric(STEP_KEY)
        self.run.define_metric("*", step_metric=STEP_KEY)
        self.hold_steps = resolve_hold_steps(self.cfg, trainer.cfg.resilience)
        if START_RECORD in trainer.context:  # MetricsLogger wrote it before wandb started
            self.held.append(wandb_record(trainer.context[START_RECORD]))
        for record in early:  # setup's events (start, resume, ...), in order
            self.on_event(trainer, record)

    def _init_run(self, trainer):
        import wandb

        id_file = trainer.run_dir.path / RUN_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:8]
        run = wandb.init(
            mode=self.cfg.mode,
            dir=str(trainer.run_dir.path),
            project=self.cfg.project,
            entity=self.cfg.entity,
            name=self.cfg.name or trainer.run_dir.path.name,
            group=self.cfg.group,
            tags=list(self.cfg.tags),
            notes=self.cfg.notes,
            config=self.config_dict,
            id=run_id,
            resume="allow",
        )
        trainer.run_dir.write_text(RUN_ID_FILE, run_id + "\n")
        return run

    def on_step_end(self, trainer, result: StepResult) -> None:
        if self.run is None:
            return
        record = result.record
        # A record of a step later than the trainer's is of the step a rollback has just undone.
        if record and record["step"] <= trainer.step:
            self.held.append(wandb_record(record))
        self.send_until(trainer.step - self.hold_steps)
        if result.samples:
            self._log_samples(trainer.step, result.samples)

    def _log_samples(self, step: int, samples: list) -> None:
        """Text samples as a `samples` table, sent at once (like events)."""
        import wandb

        rows = [[step, s.prompt, s.text, s.stop] for s in samples]
        table = wandb.Table(columns=["step", "prompt", "text", "stop"], data=rows)
        self.run.log({"samples": table, STEP_KEY: step})

    def send_until(self, step: float) -> None:
        """Send the held records of steps up to `step`, oldest first."""
        while self.held and self.held[0][STEP_KEY] <= step:
            data = self.held.popleft()
            self.run.log(data)  # no step=: wandb's own step just counts rows
            self.sent_steps.append(data[STEP_KEY])

    def abandon_after(self, step: int) -> int:
        """Drop the held records after `step` (a rollback went back to it); returns how many
        records after it were already sent (a rollback deeper than the hold): wandb keeps those,
        and the replay's records of the same steps follow them."""
        self.held = deque(r for r in self.held if r[STEP_KEY] <= step)
        first = bisect_right(self.sent_steps, step)
        num_sent = len(self.sent_steps) - first
        del self.sent_steps[first:]  # the replay's records follow the kept ones: still ascending
        return num_sent

    def on_event(self, trainer, record: dict[str, Any]) -> None:
        if self.early is not None:
            self.early.append(record)  # sent once the wandb run exists
        if self.run is None:
            return
        kind = record["kind"]
        flat = {
            f"events/{kind}/{k}": v
            for k, v in record.items()
            if isinstance(v, int | float | str) and k not in ("kind", "time")
        }
        flat[f"events/{kind}"] = 1
        flat[STEP_KEY] = record["step"]  # where it happened (a rollback: the anomaly's step)
        if kind == "rollback":
            flat["events/rollback/abandoned_sent"] = self.abandon_after(record["to_step"])
        self.run.log(flat)
        if kind in ALERTS and self.cfg.mode == "online":
            self._alert(record, flat)

    def _alert(self, record: dict[str, Any], flat: dict[str, Any]) -> None:
        import wandb

        self.run.alert(
            title=f"bigtrain {record['kind']} at step {record['step']}",
            text=", ".join(f"{k}={v}" for k, v in flat.items()),
            level=wandb.AlertLevel.WARN,
        )

    def flush(self) -> None:
        """Send everything held: the run has ended or stopped, no rollback can come any more."""
        if self.run is not None:
            self.send_until(math.inf)

    def on_finish(self, trainer) -> None:
        self.flush()

    def on_stop(self, trainer, reason: str) -> None:
        self.flush()

    def close(self) -> None:
        if self.run is not None:
            self.flush()
            self.run.finish()
            self.run = None


def wandb_record(record: dict[str, Any]) -> dict[str, Any]:
    """A metrics record as wandb keys: the step as `train/step`, scalars under `train/`; per-layer
    dicts as one key per layer under `layers/<metric>/`, prefixed with the layer's position in the
    model so that the keys sort as the layers stack (a layer x step heatmap reads them in order);
    per-rank step times as `timing/<part>/rank<r>`; per-source counts as `data/<key>/<source>`."""
    out: dict[str, Any] = {}
    for key, value in record.items():
        if key == "step_time_by_rank":
            for part, per_rank in value.items():
                out.update({f"timing/{part}/rank{r}": v for r, v in enumerate(per_rank)})
        elif key in PER_SOURCE:
            out.update({f"data/{key}/{name}": v for name, v in value.items()})
        elif isinstance(value, dict):
            width = max(2, len(str(len(value) - 1)))
            for i, (layer, v) in enumerate(value.items()):
                out[f"layers/{key.removeprefix('layer_')}/{i:0{width}d}.{layer}"] = v
        else:
            out[f"train/{key}"] = value  # "step" becomes STEP_KEY
    return out
