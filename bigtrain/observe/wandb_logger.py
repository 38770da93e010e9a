"""wandb: metrics at log steps and every event, online, offline (files under out_dir/wandb) or
disabled. The run id is kept in the run directory so a restarted run continues the same wandb run."""

from __future__ import annotations

import uuid
from typing import Any

from bigtrain.config.schema import WandbConfig
from bigtrain.hooks import Callback

RUN_ID_FILE = "wandb_run_id"


class WandbLogger(Callback):
    priority = 90

    def __init__(self, cfg: WandbConfig, config_dict: dict[str, Any]) -> None:
        self.cfg, self.config_dict = cfg, config_dict
        self.run = None

    def on_start(self, trainer) -> None:
        if not trainer.env.is_main:
            return
        import wandb

        id_file = trainer.run_dir.path / RUN_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:8]
        self.run = wandb.init(
            mode=self.cfg.mode,
            dir=str(trainer.run_dir.path),
            project=self.cfg.project,
            entity=self.cfg.entity,
            name=self.cfg.name or trainer.run_dir.path.name,
            group=self.cfg.group,
            tags=list(self.cfg.tags),
            config=self.config_dict,
            id=run_id,
            resume="allow",
        )
        trainer.run_dir.write_text(RUN_ID_FILE, run_id + "\n")
        self.run.summary["precision"] = trainer.context["policy"].to_dict()

    def on_step_end(self, trainer, metrics: dict[str, Any]) -> None:
        record = metrics.get("record")
        if self.run is not None and record:
            self.run.log(
                {f"train/{k}" if k != "step" else k: v for k, v in record.items()},
                step=record["step"],
            )

    def on_event(self, trainer, record: dict[str, Any]) -> None:
        if self.run is None:
            return
        flat = {
            f"events/{record['kind']}/{k}": v
            for k, v in record.items()
            if isinstance(v, int | float | str) and k not in ("kind", "time")
        }
        flat[f"events/{record['kind']}"] = 1
        self.run.log(flat, step=max(record["step"], self.run.step))

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
