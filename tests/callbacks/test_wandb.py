import json
import re
import struct
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from wandb.proto import wandb_internal_pb2

from bigtrain.callbacks.sink_logger import SinkLogger
from bigtrain.config.schema import WandbConfig
from bigtrain.parallel.env import DistEnv
from bigtrain.runner import run
from bigtrain.store.rundir import read_jsonl
from bigtrain.telemetry.sinks import flat_record
from bigtrain.telemetry.wandb_sink import WandbSink
from bigtrain.train.step import StepResult

LOG_BLOCK = 32768  # the .wandb file is a LevelDB log: 32 KiB blocks of chunks


def wandb_file_records(path: Path):
    """The records of an offline run's .wandb file, as wandb-core wrote them (wandb 0.31 has no
    Python reader): a 7-byte header (":W&B", key, version), then LevelDB log chunks, each with a
    7-byte header (crc32c, length, type: 1 full, 2 first, 3 middle, 4 last) that never crosses a
    block; a block's last < 7 bytes are padding."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, payload = 7, b""
    while pos + 7 <= len(data):
        if LOG_BLOCK - pos % LOG_BLOCK < 7:
            pos += LOG_BLOCK - pos % LOG_BLOCK
            continue
        length, kind = struct.unpack_from("<HB", data, pos + 4)
        assert kind in (1, 2, 3, 4), f"chunk type {kind} at byte {pos}"
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        payload = chunk if kind in (1, 2) else payload + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            yield record


def offline_run(out: Path) -> tuple[list[dict], list, Path]:
    """(history rows as dicts, metric definitions, run folder) of the run's one offline run,
    once wandb-core has written its exit record."""
    (folder,) = (out / "wandb").glob("offline-run-*")
    (path,) = folder.glob("run-*.wandb")
    for _ in range(100):  # wandb-core writes in its own process; a loaded machine may lag
        records = list(wandb_file_records(path))
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            break
        time.sleep(0.2)
    rows = [
        {
            item.nested_key[0] if item.nested_key else item.key: json.loads(item.value_json)
            for item in r.history.item
        }
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    return rows, [r.metric for r in records if r.WhichOneof("record_type") == "metric"], folder


@pytest.mark.e2e
def test_wandb_offline_writes_run_files_and_keeps_the_run_id(micro, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = micro("train.max_steps=5", "wandb.mode=offline", "train.stop_at_step=3")
    run(cfg, DistEnv())
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

    run(micro("train.max_steps=5", "wandb.mode=offline"), DistEnv())  # resumed
    assert (out / "wandb_run_id").read_text().strip() == run_id
    # One folder per wandb.init, offline-run-<start, to the second>-<run id>; wandb appends -1
    # when that name is taken: the resume's init came within the same second as the first's.
    runs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 2
    for folder in runs:
        assert re.fullmatch(rf"offline-run-\d{{8}}_\d{{6}}-{run_id}(-\d+)?", folder.name), folder
        assert [p.name for p in folder.glob("run-*.wandb")] == [f"run-{run_id}.wandb"]
    assert json.loads((out / "final.json").read_text())["step"] == 5


@pytest.mark.unit
def test_per_layer_dicts_become_keys_that_sort_in_model_order():
    layers = {f"blocks.{i}": float(i) for i in range(11)}
    out = flat_record({"step": 7, "loss": 2.5, "layer_grad_norm": {"tok_emb": 9.0, **layers}})
    assert out["train/step"] == 7 and out["train/loss"] == 2.5
    keys = [k for k in out if k.startswith("layers/")]
    assert keys[0] == "layers/grad_norm/00.tok_emb" and keys[-1] == "layers/grad_norm/11.blocks.10"
    assert sorted(keys) == keys  # lexical order = model order (blocks.10 after blocks.9)
    assert out["layers/grad_norm/03.blocks.2"] == 2.0


class StubRun:
    """What WandbSink calls on a wandb run, recorded."""

    def __init__(self):
        self.logged, self.alerts = [], []

    def log(self, data):  # never a step=: wandb's own step must only increase
        self.logged.append(data)

    def alert(self, title, text, level):
        self.alerts.append(title)

    def finish(self):
        self.logged.append("finished")


def wandb_logger(cfg: WandbConfig | None = None, hold_steps: int = 0):
    """(a started SinkLogger whose one sink is wandb on a StubRun, the stub)."""
    sink = WandbSink(cfg or WandbConfig())
    sink.run = StubRun()
    logger = SinkLogger([sink], hold_steps, {})
    logger.active, logger.early, logger.hold_steps = True, None, hold_steps
    return logger, sink.run


@pytest.mark.unit
def test_online_runs_raise_an_alert_on_rollback_abort_and_preempt():
    logger, stub = wandb_logger(WandbConfig(mode="online"))
    for kind in ("checkpoint", "rollback", "preempt"):
        logger.on_event(None, {"time": 0, "step": 5, "kind": kind, "to_step": 5, "from_step": 12})
    assert stub.alerts == ["bigtrain rollback at step 5", "bigtrain preempt at step 5"]
    assert stub.logged[1]["events/rollback/to_step"] == 5


def step_records(logger: SinkLogger, steps, loss_offset: float = 0.0) -> None:
    """Steps with a record each, as MetricsLogger hands them over (record step = trainer step)."""
    for step in steps:
        result = StepResult(step, lr=0.1, record={"step": step, "loss": step + loss_offset})
        logger.on_step_end(SimpleNamespace(step=step), result)


@pytest.mark.unit
def test_held_records_of_abandoned_steps_never_reach_wandb():
    logger, stub = wandb_logger(hold_steps=4)
    step_records(logger, range(1, 10))
    assert [d["train/step"] for d in stub.logged] == [1, 2, 3, 4, 5]  # 6..9 held
    # An anomaly at step 10 rolls back to 6: the event comes during step 10's callbacks (the
    # trainer is at 6 by then), then MetricsLogger's record of step 10.
    rollback = {"time": 0, "step": 10, "kind": "rollback", "from_step": 10, "to_step": 6}
    logger.on_event(None, rollback)
    late = StepResult(10, lr=0.1, record={"step": 10, "loss": 10.0})
    logger.on_step_end(SimpleNamespace(step=6), late)
    mark = stub.logged[-1]
    assert mark["train/step"] == 10 and mark["events/rollback"] == 1
    assert mark["events/rollback/to_step"] == 6 and mark["events/rollback/abandoned_sent"] == 0
    step_records(logger, range(7, 13), loss_offset=0.5)  # the replay
    logger.on_stop(None, "abort")  # sends what is held
    logged = [d for d in stub.logged if "train/loss" in d]
    assert [d["train/step"] for d in logged] == list(range(1, 13))
    assert [d["train/loss"] for d in logged] == [1, 2, 3, 4, 5, 6] + [s + 0.5 for s in range(7, 13)]
    logger.close()
    assert stub.logged[-1] == "finished" and logger.sinks[0].run is None


@pytest.mark.unit
def test_a_rollback_deeper_than_the_hold_counts_the_records_wandb_keeps():
    logger, stub = wandb_logger(hold_steps=0)
    step_records(logger, range(1, 9))
    rollback = {"time": 0, "step": 8, "kind": "rollback", "from_step": 8, "to_step": 5}
    logger.on_event(None, rollback)
    assert stub.logged[-1]["events/rollback/abandoned_sent"] == 3  # steps 6, 7, 8
    step_records(logger, range(6, 10), loss_offset=0.5)
    logger.on_event(None, {**rollback, "from_step": 9, "to_step": 7})
    assert stub.logged[-1]["events/rollback/abandoned_sent"] == 2  # replayed 8, 9 only
    steps = [d["train/step"] for d in stub.logged if "train/loss" in d]
    assert steps == [1, 2, 3, 4, 5, 6, 7, 8, 6, 7, 8, 9]  # all in wandb: its own step increases


def kept_trajectory(records: list[dict]) -> list[dict]:
    """metrics.jsonl's records that the run kept: read in file order, a record at a step <= an
    earlier one's is a replay after a rollback, and cuts the earlier records from that step on."""
    kept: list[dict] = []
    for record in records:
        kept = [r for r in kept if r["step"] < record["step"]] + [record]
    return kept


@pytest.mark.e2e
def test_wandb_history_is_the_kept_trajectory_after_a_rollback(micro, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = micro(
        "train.max_steps=20",
        "train.log_every=1",
        "resilience.snapshot_every=5",
        "resilience.confirm_steps=3",  # hold_steps: 5 + 3
        "drill.nan_grad_step=12",
        "wandb.mode=offline",
    )
    assert run(cfg, DistEnv())["rollbacks"] == 1
    out = Path(cfg.train.out_dir)
    rows, definitions, folder = offline_run(out)
    metrics = read_jsonl(out / "metrics.jsonl")
    kept = kept_trajectory(metrics)
    assert [m["step"] for m in metrics if "loss" in m].count(8) == 2  # 6..12 logged twice
    assert [m["step"] for m in kept] == list(range(0, 21))  # step 0: the first evaluation
    # wandb holds the kept trajectory only, in step order, with the same values.
    train = [r for r in rows if "train/loss" in r]
    assert [r["train/step"] for r in train] == list(range(1, 21))
    assert [r["train/loss"] for r in train] == [m["loss"] for m in kept[1:]]
    val = [r for r in rows if "train/val_loss" in r]
    assert [r["train/step"] for r in val] == [0, 10, 20]
    assert [r["train/val_loss"] for r in val] == [m["val_loss"] for m in kept if "val_loss" in m]
    (rollback,) = [r for r in rows if "events/rollback" in r]
    assert rollback["train/step"] == 12 and rollback["events/rollback/to_step"] == 5
    assert rollback["events/rollback/abandoned_sent"] == 0
    (anomaly,) = [r for r in rows if "events/anomaly" in r]
    assert anomaly["train/step"] == 12
    (start,) = [r for r in rows if "events/start" in r]  # setup's events reach wandb too
    assert start["train/step"] == 0 and start["events/start/backend"] == "local"
    # Every chart's x-axis is the training step; wandb's own step only increases, dropping nothing.
    assert any(d.glob_name == "*" and d.step_metric == "train/step" for d in definitions)
    assert [r["_step"] for r in rows] == list(range(len(rows)))
    debug = (folder / "logs" / "debug-internal.log").read_text()
    assert "ignoring partial history record" not in debug and "less than the current" not in debug
