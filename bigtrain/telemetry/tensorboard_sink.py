"""The TensorBoard sink: event files under RUN_DIR/tensorboard/ (torch.utils.tensorboard's
SummaryWriter; `pip install bigtrain[tensorboard]`).

Scalars by the training step (the same keys as wandb's: `train/loss`, `layers/...`); events as a
marker scalar `events/<kind>` = 1 and a text `events/<kind>` with their details; the resolved
config and the precision policy as hyperparameters (the HParams tab) and as text (`config`,
`precision`); text samples as text `samples`; final.json's figures as `final/<key>` scalars at the
last step and the text `final`. A restarted run appends a new event file to the same folder and
purges from the view what the earlier process logged after the resumed step (TensorBoard's
`purge_step`), so the charts show the trajectory the run kept across restarts as well."""

from __future__ import annotations

import json
from typing import Any

from bigtrain.config.load import flatten
from bigtrain.telemetry.sinks import SinkRun, numbers

FOLDER = "tensorboard"


def hparam_value(value: Any) -> int | float | str | bool:
    """A config value as the HParams plugin takes it: numbers, strings and bools as they are,
    anything else (lists, dicts, None) as JSON text."""
    return value if isinstance(value, int | float | str | bool) else json.dumps(value)


def details_text(record: dict[str, Any]) -> str:
    return "  \n".join(f"**{k}**: `{json.dumps(v)}`" for k, v in record.items() if k != "time")


class TensorBoardSink:
    name = "tensorboard"

    def __init__(self) -> None:
        self.writer = None
        self.step = 0  # the last step logged (final.json's figures go there)

    def start(self, run: SinkRun) -> None:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        purge = run.start_step + 1 if run.start_step > 0 else None
        self.writer = SummaryWriter(str(run.path / FOLDER), purge_step=purge)
        self.step = run.start_step
        params = {k: hparam_value(v) for k, v in flatten(run.config).items()}
        params.update({f"policy/{k}": v["choice"] for k, v in run.policy.items()})
        for summary in hparams(params, {"train/loss": float("nan")}):
            self.writer.file_writer.add_summary(summary)
        self.writer.add_text("config", "```\n" + json.dumps(run.config, indent=1) + "\n```")
        rows = [f"| {k} | {v['choice']} | {v['reason']} |" for k, v in run.policy.items()]
        table = "| component | choice | reason |\n| --- | --- | --- |\n" + "\n".join(rows)
        self.writer.add_text("precision", table, run.start_step)

    def log_record(self, step: int, flat: dict[str, Any]) -> None:
        for key, value in numbers(flat).items():
            self.writer.add_scalar(key, value, step)
        self.step = max(self.step, step)

    def log_event(self, step: int, record: dict[str, Any], flat: dict[str, Any]) -> None:
        kind = record["kind"]
        self.writer.add_scalar(f"events/{kind}", 1.0, step)
        self.writer.add_text(f"events/{kind}", details_text(record), step)

    def log_samples(self, step: int, samples: list) -> None:
        rows = [f"| {s.prompt!r} | {s.text!r} | {s.stop} |" for s in samples]
        text = "| prompt | text | stop |\n| --- | --- | --- |\n" + "\n".join(rows)
        self.writer.add_text("samples", text, step)

    def log_summary(self, figures: dict[str, Any]) -> None:
        step = int(figures.get("step", self.step))
        for key, value in numbers(figures).items():
            self.writer.add_scalar(f"final/{key}", value, step)
        self.writer.add_text("final", details_text(figures), step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
