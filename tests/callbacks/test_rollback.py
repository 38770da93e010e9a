"""Coordinated rollback: snapshots, the ladder, skip windows, LR back-off, preemption, restarts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bigtrain.checkpoint.manifest import verify
from bigtrain.parallel.env import DistEnv
from bigtrain.runner import run
from bigtrain.store.rundir import read_jsonl
from bigtrain.train import lr_at
from tests.conftest import run_cli

ENV = DistEnv()
ROLLBACK = (
    "resilience.snapshot_every=5",
    "resilience.confirm_steps=3",
    "checkpoint.every=10",
)


def events_of(cfg, kind: str) -> list[dict]:
    return [e for e in read_jsonl(Path(cfg.train.out_dir) / "events.jsonl") if e["kind"] == kind]


@pytest.mark.e2e
def test_nan_rolls_back_to_the_newest_good_snapshot_and_skips_the_data(micro):
    cfg = micro("train.max_steps=20", *ROLLBACK, "drill.nan_grad_step=12")
    final = run(cfg, ENV)
    assert final["step"] == 20 and final["rollbacks"] == 1 and final["anomalies"] == 1
    (anomaly,) = events_of(cfg, "anomaly")
    assert anomaly["step"] == 12 and anomaly["action"] == "rollback"
    # Snapshot 10 had 1 healthy step of the 3 it needs: the good one is step 5.
    (rollback,) = events_of(cfg, "rollback")
    assert (rollback["from_step"], rollback["to_step"], rollback["source"]) == (12, 5, "memory")
    (skip,) = events_of(cfg, "skip_data")
    assert (skip["start"], skip["end"]) == (5 * 8, 12 * 8)  # from the snapshot's cursor on
    (backoff,) = events_of(cfg, "lr_backoff")
    # backed off for twice the steps rolled back (resilience.lr_cooldown_steps=None)
    assert backoff["lr_scale"] == 0.5 and backoff["until_step"] == 5 + 2 * (12 - 5)
    faults = events_of(cfg, "fault")  # the fault fires again when the step is replayed
    # every event of the anomaly carries the step it happened in
    assert {e["step"] for e in (*faults, anomaly, rollback, skip, backoff)} == {12}
    metrics = [m for m in read_jsonl(Path(cfg.train.out_dir) / "metrics.jsonl") if "lr" in m]
    after = [m for m in metrics if m["step"] == 15][-1]  # step 15 of the new timeline
    assert after["lr"] == pytest.approx(0.5 * lr_at(14, 20, cfg.optim))
    # The checkpoint written right after the rollback carries the skip window.
    manifest = json.loads(
        (Path(cfg.train.out_dir) / "checkpoints/step_00000020/manifest.json").read_text()
    )
    assert manifest["data"]["skip_windows"] == [[40, 96]]
    assert manifest["data"]["cursor"] == 96 + 15 * 8  # the bad window was never replayed


@pytest.mark.e2e
def test_the_skip_window_survives_a_restart_bit_exactly(micro):
    straight = run(micro("train.max_steps=20", *ROLLBACK, "drill.nan_grad_step=12"), ENV)
    args = ("train.max_steps=20", *ROLLBACK, "drill.nan_grad_step=12")
    run(micro(*args, "train.stop_at_step=16", out="restarted"), ENV)
    resumed = run(micro(*args, out="restarted"), ENV)
    assert resumed["fingerprint"] == straight["fingerprint"]
    assert resumed["rollbacks"] == 1


@pytest.mark.e2e
def test_a_repeat_within_the_window_goes_one_snapshot_further_back(micro):
    cfg = micro("train.max_steps=30", *ROLLBACK, "drill.nan_grad_step=[22,25]")
    final = run(cfg, ENV)
    assert final["step"] == 30 and final["rollbacks"] == 2
    rollbacks = events_of(cfg, "rollback")
    assert [(e["from_step"], e["to_step"], e["repeat"]) for e in rollbacks] == [
        (22, 15, False),
        (25, 10, True),
    ]
    assert events_of(cfg, "lr_backoff")[-1]["lr_scale"] == 0.25  # compounding


@pytest.mark.e2e
def test_anomalies_at_every_step_exit_3_with_the_last_good_checkpoint_intact(micro_args, tmp_path):
    args = micro_args(
        "train.max_steps=30",
        *ROLLBACK,
        "drill.nan_grad_step=[" + ",".join(str(s) for s in range(12, 31)) + "]",
    )
    result = run_cli("train", *args)
    assert result.returncode == 3, result.stderr[-2000:]
    out = tmp_path / "run"
    assert (out / "ABORTED").is_file()
    kinds = [e["kind"] for e in read_jsonl(out / "events.jsonl")]
    assert kinds.count("rollback") >= 1 and kinds[-2:] == ["abort", "costs"]  # then the totals
    committed = sorted(p for p in (out / "checkpoints").iterdir() if p.name[5:].isdigit())
    assert committed and verify(committed[-1])["step"] <= 10


@pytest.mark.e2e
def test_preemption_checkpoints_exits_4_and_resumes_bit_exactly(micro_args, micro, tmp_path):
    args = micro_args("train.max_steps=12", "checkpoint.every=100", "drill.sigterm_step=7")
    result = run_cli("train", *args)
    assert result.returncode == 4, result.stderr[-2000:]
    out = tmp_path / "run"
    (preempt,) = [e for e in read_jsonl(out / "events.jsonl") if e["kind"] == "preempt"]
    # Sent after step 7; every rank learns of it in step 8's all-reduce and stops there.
    assert preempt["step"] == 8 and "SIGTERM" in preempt["reason"]
    assert verify(out / "checkpoints" / "step_00000008")["step"] == 8
    again = run_cli("train", *args)  # the signal fired once: the restart finishes
    assert again.returncode == 0, again.stderr[-2000:]
    final = json.loads((out / "final.json").read_text())
    straight = run(micro("train.max_steps=12", "checkpoint.every=100", out="straight"), ENV)
    assert final["fingerprint"] == straight["fingerprint"]


@pytest.mark.e2e
def test_corrupt_checkpoint_drill_resumes_from_the_one_before(micro):
    run(micro("train.max_steps=20", "checkpoint.every=10", "train.stop_at_step=20"), ENV)
    cfg = micro("train.max_steps=25", "checkpoint.every=10", "drill.corrupt_checkpoint=true")
    final = run(cfg, ENV)
    assert final["step"] == 25
    (fault,) = [e for e in events_of(cfg, "fault") if e["type"] == "corrupt_checkpoint"]
    assert "step_00000020" in fault["file"]
    assert events_of(cfg, "resume")[-1]["path"].endswith("step_00000010")
    assert "step_00000020" in events_of(cfg, "checkpoint_invalid")[0]["path"]


@pytest.mark.e2e
def test_a_nonfinite_state_is_never_checkpointed(micro, monkeypatch):
    from bigtrain.callbacks import checkpointing as callback

    monkeypatch.setattr(callback, "nonfinite_state_values", lambda backend, device: 3)
    cfg = micro("train.max_steps=10", "checkpoint.every=5")
    run(cfg, ENV)
    assert [e["step"] for e in events_of(cfg, "checkpoint_refused")] == [5, 10]
    assert not list((Path(cfg.train.out_dir) / "checkpoints").glob("step_*"))


@pytest.mark.e2e
def test_sigkill_between_write_and_commit_never_loads_the_half_checkpoint(micro_args, tmp_path):
    """FSDP2 with async checkpoints: the step-3 checkpoint's files are being written when the
    process is SIGKILLed at step 4, before the commit. The restart never loads it."""
    args = micro_args(
        "parallel.backend=fsdp",
        "train.max_steps=6",
        "checkpoint.every=3",
        "train.eval_every=0",
        "drill.kill_step=4",
    )
    result = run_cli("train", *args)
    assert result.returncode == -9, result.stderr[-2000:]
    root = tmp_path / "run" / "checkpoints"
    assert [p.name for p in root.iterdir()] == [".tmp-step_00000003"]
    again = run_cli("train", *args)
    assert again.returncode == 0, again.stderr[-2000:]
    kinds = [e["kind"] for e in read_jsonl(tmp_path / "run" / "events.jsonl")]
    assert "resume" not in kinds  # nothing committed: started over
    assert sorted(p.name for p in root.iterdir()) == ["step_00000003", "step_00000006"]
