import json
import time
from pathlib import Path

from bigtrain.build import run
from bigtrain.observe.wandb_logger import wandb_record
from bigtrain.parallel.env import DistEnv


def test_wandb_offline_writes_run_files_and_keeps_the_run_id(micro, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = micro("train.max_steps=5", "wandb.mode=offline", "train.stop_at_step=3")
    run(cfg, DistEnv(), log=lambda *_: None)
    out = Path(cfg.train.out_dir)
    run_id = (out / "wandb_run_id").read_text().strip()
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and runs[0].name.endswith(run_id)
    logs = list(runs[0].glob("run-*.wandb"))  # the offline record log that `wandb sync` uploads
    assert len(logs) == 1
    # wandb-core writes the record log in its own process; give a loaded machine a moment.
    for _ in range(50):
        data = logs[0].read_bytes()
        if b"layers/grad_max" in data:
            break
        time.sleep(0.2)
    assert b"train/loss" in data and b"micro_batch_size" in data and b"events/checkpoint" in data
    assert b"layers/grad_norm/00.tok_emb" in data and b"layers/grad_max/02.blocks.0" in data

    run(micro("train.max_steps=5", "wandb.mode=offline"), DistEnv(), log=lambda *_: None)  # resumed
    assert (out / "wandb_run_id").read_text().strip() == run_id
    assert all(p.name.endswith(run_id) for p in (out / "wandb").glob("offline-run-*"))
    assert json.loads((out / "final.json").read_text())["step"] == 5


def test_per_layer_dicts_become_keys_that_sort_in_model_order():
    layers = {f"blocks.{i}": float(i) for i in range(11)}
    out = wandb_record({"step": 7, "loss": 2.5, "layer_grad_norm": {"tok_emb": 9.0, **layers}})
    assert out["step"] == 7 and out["train/loss"] == 2.5
    keys = [k for k in out if k.startswith("layers/")]
    assert keys[0] == "layers/grad_norm/00.tok_emb" and keys[-1] == "layers/grad_norm/11.blocks.10"
    assert sorted(keys) == keys  # lexical order = model order (blocks.10 after blocks.9)
    assert out["layers/grad_norm/03.blocks.2"] == 2.0


def test_online_runs_raise_an_alert_on_rollback_abort_and_preempt():
    from bigtrain.config.schema import WandbConfig
    from bigtrain.observe.wandb_logger import WandbLogger

    class StubRun:
        step = 0

        def __init__(self):
            self.logged, self.alerts = [], []

        def log(self, data, step):
            self.logged.append((step, data))

        def alert(self, title, text, level):
            self.alerts.append(title)

    logger = WandbLogger(WandbConfig(mode="online"), {})
    logger.run = StubRun()
    for kind in ("checkpoint", "rollback", "preempt"):
        logger.on_event(None, {"time": 0, "step": 12, "kind": kind, "to_step": 5})
    assert logger.run.alerts == ["bigtrain rollback at step 12", "bigtrain preempt at step 12"]
    assert logger.run.logged[1][1]["events/rollback/to_step"] == 5
    logger.run = None  # nothing to finish
