"""wandb: metrics at log steps and every event, online, offline (files under out_dir/wandb) or
disabled. The run id is kept in the run directory so a restarted run continues the same wandb run."""

from __future__ import annotations

import uuid
from typing import Any

from bigtrain.config.schema import WandbConfig
from bigtrain.hooks import Callback

RUN_ID_FILE = "wandb_run_id"
ALERTS = ("rollback", "abort", "preempt")  # online runs also raise a wandb alert for these


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
            notes=self.cfg.notes,
            config=self.config_dict,
            id=run_id,
            resume="allow",
        )
        trainer.run_dir.write_text(RUN_ID_FILE, run_id + "\n")
        self.run.summary["precision"] = trainer.context["policy"].to_dict()

    def on_step_end(self, trainer, metrics: dict[str, Any]) -> None:
        record = metrics.get("record")
        if self.run is not None and record:
            self.run.log(wandb_record(record), step=record["step"])

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
        if record["kind"] in ALERTS and self.cfg.mode == "online":
            import wandb

            text = ", ".join(f"{k}={v}" for k, v in flat.items())
            self.run.alert(
                title=f"bigtrain {record['kind']} at step {record['step']}",
                text=text,
                level=wandb.AlertLevel.WARN,
            )

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


def wandb_record(record: dict[str, Any]) -> dict[str, Any]:
    """A metrics record as wandb keys: scalars under `train/`; per-layer dicts as one key per layer
    under `layers/<metric>/`, prefixed with the layer's position in the model so that the keys
    sort as the layers stack (a layer x step heatmap reads them in order); per-rank step times as
    `timing/<part>/rank<r>`."""
    out: dict[str, Any] = {}
    for key, value in record.items():
        if key == "step":
            out[key] = value
        elif key == "step_time_by_rank":
            for part, per_rank in value.items():
                out.update({f"timing/{part}/rank{r}": v for r, v in enumerate(per_rank)})
        elif isinstance(value, dict):
            width = max(2, len(str(len(value) - 1)))
            for i, (layer, v) in enumerate(value.items()):
                out[f"layers/{key.removeprefix('layer_')}/{i:0{width}d}.{layer}"] = v
        else:
            out[f"train/{key}"] = value
    return out
