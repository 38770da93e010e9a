"""Metric sinks: every sink gets the same held records (the kept trajectory after a rollback),
events, config, policy and final.json's figures; TensorBoard's event files read back with
tensorboard's EventAccumulator and MLflow's runs with MlflowClient."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from bigtrain.callbacks.sink_logger import SinkLogger, configured_sinks, make_sinks
from bigtrain.config import load_config
from bigtrain.errors import ConfigError
from bigtrain.parallel.env import DistEnv
from bigtrain.runner import run
from bigtrain.store.rundir import read_jsonl
from bigtrain.telemetry.sinks import flat_figures
from bigtrain.telemetry.trajectory import split_trajectory
from bigtrain.train.step import StepResult

ROLLBACK = (
    "train.max_steps=20",
    "train.log_every=1",
    "resilience.snapshot_every=5",
    "resilience.confirm_steps=3",  # hold_steps: 5 + 3
    "drill.nan_grad_step=12",
)


class StubSink:
    """A sink that records every call."""

    def __init__(self, name: str) -> None:
        self.name, self.calls = name, []

    def start(self, run) -> None:
        self.calls.append(("start", run.start_step))

    def log_record(self, step, flat) -> None:
        self.calls.append(("record", step, flat["train/loss"]))

    def log_event(self, step, record, flat) -> None:
        self.calls.append(("event", step, record["kind"], dict(flat)))

    def log_samples(self, step, samples) -> None:
        self.calls.append(("samples", step))

    def log_summary(self, figures) -> None:
        self.calls.append(("summary", figures))

    def close(self) -> None:
        self.calls.append(("close",))


def started(sinks, hold_steps: int) -> SinkLogger:
    logger = SinkLogger(sinks, hold_steps, {})
    logger.active, logger.early, logger.hold_steps = True, None, hold_steps
    return logger


@pytest.mark.unit
def test_every_sink_gets_the_same_kept_records_and_the_summary():
    sinks = [StubSink("a"), StubSink("b")]
    logger = started(sinks, hold_steps=3)
    for step in range(1, 9):
        logger.on_step_end(
            SimpleNamespace(step=step), StepResult(step, 0.1, record={"step": step, "loss": step})
        )
    logger.on_event(None, {"time": 0, "step": 8, "kind": "rollback", "from_step": 8, "to_step": 5})
    for step in range(6, 9):  # the replay
        record = {"step": step, "loss": step + 0.5}
        logger.on_step_end(SimpleNamespace(step=step), StepResult(step, 0.1, record=record))
    final = {
        "time": 0,
        "step": 8,
        "kind": "finish",
        "loss": 8.5,
        "peak_memory_bytes_by_rank": [7, 9],
    }
    logger.on_event(None, final)
    logger.close()
    assert sinks[0].calls == sinks[1].calls
    records = [c[1:] for c in sinks[0].calls if c[0] == "record"]
    assert records == [(1, 1), (2, 2), (3, 3), (4, 4), (5, 5), (6, 6.5), (7, 7.5), (8, 8.5)]
    rollback = next(c for c in sinks[0].calls if c[:3] == ("event", 8, "rollback"))
    assert rollback[3]["events/rollback/abandoned_sent"] == 0  # 6..8 were still held
    assert sinks[0].calls[-2][1] == {
        "step": 8,
        "loss": 8.5,
        "peak_memory_bytes/rank0": 7,
        "peak_memory_bytes/rank1": 9,
    }
    assert sinks[0].calls[-1] == ("close",)


@pytest.mark.unit
def test_flat_figures_split_lists_by_rank():
    figures = flat_figures({"time": 1, "kind": "finish", "loss": 2.0, "x_by_rank": [1, 2]})
    assert figures == {"loss": 2.0, "x/rank0": 1, "x/rank1": 2}


@pytest.mark.unit
def test_wandb_disabled_keeps_wandb_out_and_a_missing_package_is_exit_2(tmp_path, monkeypatch):
    cfg = load_config([], ["wandb.mode=disabled", "log.sinks=[wandb,tensorboard]"])
    assert configured_sinks(cfg.log, cfg.wandb) == ["tensorboard"]
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name == "mlflow" else real(name)
    )
    cfg = load_config([], [f"train.out_dir={tmp_path}", "log.sinks=[mlflow]"])
    with pytest.raises(
        ConfigError, match=r"'mlflow' is not installed: pip install 'bigtrain\[mlflow\]'"
    ):
        make_sinks(cfg.log, cfg.wandb, tmp_path)
    with pytest.raises(ConfigError, match="expected distinct names of"):
        load_config([], ["log.sinks=[wandb,neptune]"])


def kept_losses(out: Path) -> tuple[list[int], list[float]]:
    kept, abandoned = split_trajectory(read_jsonl(out / "metrics.jsonl"))
    assert abandoned  # the rollback replayed logged steps
    kept = [r for r in kept if "loss" in r]
    return [r["step"] for r in kept], [r["loss"] for r in kept]


@pytest.mark.e2e
def test_tensorboard_and_mlflow_hold_the_kept_trajectory_config_and_policy(micro):
    pytest.importorskip("tensorboard", reason="pip install 'bigtrain[tensorboard]'")
    pytest.importorskip("mlflow", reason="pip install 'bigtrain[mlflow]'")
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = micro(*ROLLBACK, "log.sinks=[tensorboard,mlflow]")
    final = run(cfg, DistEnv())
    assert final["rollbacks"] == 1
    out = Path(cfg.train.out_dir)
    steps, losses = kept_losses(out)
    assert steps == list(range(1, 21))

    board = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    board.Reload()
    loss = board.Scalars("train/loss")
    assert [e.step for e in loss] == steps
    assert [e.value for e in loss] == pytest.approx(losses, rel=1e-6)  # stored as float32
    assert [e.step for e in board.Scalars("events/rollback")] == [12]
    assert "_hparams_/session_start_info" in board.PluginTagToContent("hparams")
    policy = board.Tensors("precision/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "| master weights | fp32 |" in policy
    config = board.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert '"drill": {' in config and '"nan_grad_step": [\n   12' in config
    assert board.Scalars("final/rollbacks")[0].value == 1.0

    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    mlrun = client.get_run((out / "mlflow_run_id").read_text().strip())
    history = client.get_metric_history(mlrun.info.run_id, "train/loss")
    assert [m.step for m in history] == steps and [m.value for m in history] == losses
    assert (
        mlrun.data.params["optim.lr"] == "0.003"
        and mlrun.data.params["policy.master weights"] == "fp32"
    )
    assert mlrun.data.metrics["final/rollbacks"] == 1 and mlrun.data.metrics["final/step"] == 20
    assert mlrun.data.tags["final.fingerprint"] == final["fingerprint"]
    assert [m.step for m in client.get_metric_history(mlrun.info.run_id, "events/rollback")] == [12]
    assert mlrun.info.status == "FINISHED"


@pytest.mark.e2e
def test_a_restarted_run_continues_its_mlflow_run_at_mlflow_tracking_uri(
    micro, tmp_path, monkeypatch
):
    pytest.importorskip("tensorboard", reason="pip install 'bigtrain[tensorboard]'")
    pytest.importorskip("mlflow", reason="pip install 'bigtrain[mlflow]'")
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    uri = f"sqlite:///{tmp_path / 'elsewhere.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    common = ("train.max_steps=8", "train.log_every=2", "checkpoint.every=4", "train.eval_every=0")
    cfg = micro(*common, "log.sinks=[tensorboard,mlflow]")
    run(micro(*common, "train.stop_at_step=6", "log.sinks=[tensorboard,mlflow]"), DistEnv())
    out = Path(cfg.train.out_dir)
    shutil.rmtree(out / "checkpoints" / "step_00000006")  # as if it crashed after step 6
    run(cfg, DistEnv())  # resumes at the checkpoint of step 4: steps 5..8 again
    assert not (out / "mlflow.db").exists()  # the store is the environment's
    assert (tmp_path / "mlartifacts").is_dir()  # beside its database, not in the working dir
    client = MlflowClient(uri)
    (mlrun,) = client.search_runs([client.get_experiment_by_name("bigtrain").experiment_id])
    assert mlrun.info.run_id == (out / "mlflow_run_id").read_text().strip()
    # MLflow appends (like wandb): step 6 from the first process, then the resumed run's 6 and 8.
    steps = [m.step for m in client.get_metric_history(mlrun.info.run_id, "train/loss")]
    assert steps == [2, 4, 6, 6, 8]
    board = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    board.Reload()  # TensorBoard purges what the first process logged after the resumed step
    assert [e.step for e in board.Scalars("train/loss")] == [2, 4, 6, 8]
