"""Exact recovery in whole runs (local backend): a rolled-back run continues exactly as a fresh run
resumed from its restored state, and a run stopped and resumed heals to the same step and keeps
the same trajectory as one that never stopped, also when the target must be rebuilt (its snapshot
went with the restart) or is the start (rebuilt from the initial weights). FSDP2 and the other
backends: test_backends.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from bigtrain.parallel.env import DistEnv
from bigtrain.runner import run
from bigtrain.store.rundir import read_jsonl
from bigtrain.telemetry.trajectory import split_trajectory

pytestmark = pytest.mark.e2e

ENV = DistEnv()
EXACT = ("train.log_every=1", "train.eval_every=0", "checkpoint.async_save=false")


def events(cfg, kind: str) -> list[dict]:
    return [e for e in read_jsonl(Path(cfg.train.out_dir) / "events.jsonl") if e["kind"] == kind]


def kept_losses(cfg) -> dict[int, float]:
    """The loss of every step of the trajectory the run carried on with."""
    records = [m for m in read_jsonl(Path(cfg.train.out_dir) / "metrics.jsonl") if "loss" in m]
    return {m["step"]: m["loss"] for m in split_trajectory(records)[0]}


@pytest.mark.parametrize(
    "precision",
    [
        (),
        # INT8 calibration folds every step's activations (callback state a target holds too)
        ("precision.int8.enabled=true", "precision.int8.calibration=ema"),
    ],
    ids=["bf16", "int8"],
)
def test_a_rolled_back_run_equals_a_fresh_run_resumed_from_its_restored_state(
    micro, tmp_path, precision
):
    """NaN at step 12 rolls back to snapshot 5; the checkpoint written right after holds step 5's
    state with the skip window and the back-off. A new run resumed from that checkpoint alone,
    without the fault, ends bit for bit where the rolled-back run ends."""
    ladder = (
        "resilience.snapshot_every=5",
        "resilience.confirm_steps=3",
        "checkpoint.every=100",
        "precision.int8.calibration_steps=8",
        *precision,
    )
    healed = micro("train.max_steps=24", *EXACT, *ladder, "drill.nan_grad_step=12", out="healed")
    first = run(healed, ENV)
    (rollback,) = events(healed, "rollback")
    assert (rollback["to_step"], rollback["source"]) == (5, "memory")
    restored = Path(healed.train.out_dir) / "checkpoints" / "step_00000005"
    fresh_dir = tmp_path / "fresh" / "checkpoints"
    fresh_dir.mkdir(parents=True)
    shutil.copytree(restored, fresh_dir / restored.name)
    fresh = micro("train.max_steps=24", *EXACT, *ladder, out="fresh")
    second = run(fresh, ENV)
    (resume,) = events(fresh, "resume")
    assert resume["path"].endswith("step_00000005")
    assert second["fingerprint"] == first["fingerprint"] and second["rollbacks"] == 1
    after = {s: v for s, v in kept_losses(healed).items() if s > 5}
    assert kept_losses(fresh) == after and sorted(after) == list(range(6, 25))
    assert [e["kind"] for e in events(fresh, "anomaly")] == []


INT8 = ("precision.int8.enabled=true", "precision.int8.calibration=ema")


@pytest.mark.parametrize(
    ("stop", "fault", "to_step", "resumed_source", "precision"),
    [
        (30, 37, 25, "replay from checkpoint", ()),  # snapshot 25 went with the restart: rebuilt
        (10, 13, 0, "start", ()),  # checkpoint 10 is not confirmed: the start, rebuilt
        # the straight run's snapshot of step 20 against the resumed run's checkpoint of it: the
        # same state only if both hold what the step's callbacks changed (INT8 calibration)
        (30, 33, 20, "checkpoint", INT8),
    ],
    ids=["rebuilt", "start", "int8-checkpoint"],
)
def test_a_run_stopped_and_resumed_heals_like_one_that_never_stopped(
    micro, stop, fault, to_step, resumed_source, precision
):
    """Checkpoints every 10 steps and snapshots every 25 (both rollback targets), confirmation
    after 10 healthy steps; a NaN after the resume point."""
    args = (
        "train.max_steps=40",
        *EXACT,
        "checkpoint.every=10",
        f"drill.nan_grad_step={fault}",
        *precision,
    )
    straight = micro(*args, out="straight")
    uninterrupted = run(straight, ENV)
    stopped = micro(*args, f"train.stop_at_step={stop}", out="stopped")
    run(stopped, ENV)
    resumed = run(micro(*args, out="stopped"), ENV)
    (one,), (other,) = events(straight, "rollback"), events(stopped, "rollback")
    assert (one["from_step"], one["to_step"], one["source"]) == (fault, to_step, "memory")
    assert (other["from_step"], other["to_step"], other["source"]) == (
        fault,
        to_step,
        resumed_source,
    )
    assert [e["samples"] for e in events(stopped, "skip_data")] == [
        e["samples"] for e in events(straight, "skip_data")
    ]
    assert resumed["fingerprint"] == uninterrupted["fingerprint"]
    assert kept_losses(stopped) == kept_losses(straight)
    if resumed_source.startswith("replay"):
        (rebuilt,) = events(stopped, "rebuilt")
        assert (rebuilt["from_step"], rebuilt["to_step"]) == (20, 25)
