"""The rollback ladder step by step on a stub trainer (tests/stubs.py): which snapshots exist and
count as good, what a rollback restores, skips and backs off, when it goes further back, to the
starting state or to disk, and when it gives up. The whole ladder in real runs:
tests/callbacks/test_rollback.py and test_heal.py."""

from __future__ import annotations

import random

import pytest
import torch

from bigtrain.callbacks.guard import AnomalyGuard
from bigtrain.callbacks.rollback import Rollback
from bigtrain.config.schema import MonitorConfig, ResilienceConfig
from bigtrain.errors import AbortRun
from bigtrain.store.rundir import read_jsonl
from tests.stubs import GLOBAL_BATCH as B
from tests.stubs import StubManager, StubTrainer, nonfinite, spike

pytestmark = pytest.mark.unit

LADDER = {"snapshot_every": 5, "snapshots": 3, "confirm_steps": 3}


def make(tmp_path, **resilience) -> tuple[StubTrainer, Rollback, StubManager]:
    manager = StubManager(tmp_path / "checkpoints")
    rollback = Rollback(ResilienceConfig(**{**LADDER, **resilience}), manager)
    trainer = StubTrainer(tmp_path / "run", [rollback])
    trainer.callbacks.on_start(trainer)
    return trainer, rollback, manager


def nan_step(trainer: StubTrainer):
    """A non-finite step as the loop ends it (not applied) with the guard's `rollback`."""
    return trainer.step_end(nonfinite(), action="rollback", skipped=True)


def weight(trainer: StubTrainer) -> float:
    """The backend's weight: the number of updates applied to the state it holds."""
    return trainer.backend.weight[0].item()


def test_snapshots_every_n_steps_skip_skipped_steps_and_keep_the_newest(tmp_path):
    trainer, rollback, _ = make(tmp_path)
    assert (rollback.origin.step, rollback.origin.healthy_after) == (0, 3)  # good by definition
    trainer.healthy(9)
    trainer.step_end(skipped=True)  # step 10 was not applied: no snapshot of it
    trainer.healthy(15)
    assert [s.step for s in rollback.ring] == [15, 20, 25]  # 5 left the ring of 3
    assert [s.healthy_after for s in rollback.ring] == [10, 5, 0]
    newest = rollback.ring[-1]
    assert newest.backend_state["weight"].tolist() == [24.0] * 3  # 25 steps, one skipped
    assert newest.trainer_state["data"]["cursor"] == 25 * B
    assert newest.trainer_state["state"]["skipped_steps"] == 1
    # The checkpoint of step 25 writes from this copy instead of copying again.
    assert trainer.host_copy.step == 25 and trainer.host_copy.state is newest.backend_state


def test_no_snapshots_and_no_starting_state_when_snapshots_are_off(tmp_path):
    trainer, rollback, _ = make(tmp_path, snapshot_every=0)
    trainer.healthy(10)
    assert rollback.origin is None and not rollback.ring and trainer.host_copy is None


@pytest.mark.parametrize(("healthy_after_snapshot", "to_step"), [(2, 0), (3, 5)])
def test_a_snapshot_is_good_once_confirm_steps_healthy_steps_followed_it(
    tmp_path, healthy_after_snapshot, to_step
):
    trainer, _, _ = make(tmp_path)
    trainer.healthy(5 + healthy_after_snapshot)
    nan_step(trainer)
    (event,) = trainer.events("rollback")
    assert (event["to_step"], trainer.step, weight(trainer)) == (to_step, to_step, to_step)


def test_an_anomaly_before_confirmation_poisons_a_snapshot_for_good(tmp_path):
    trainer, rollback, _ = make(tmp_path)
    trainer.healthy(7)  # snapshot 5 and two healthy steps after it, one short of confirmed
    trainer.step_end(spike(), action="warn")  # step 8: applied, no rollback
    assert not trainer.events("rollback") and weight(trainer) == 8
    trainer.healthy(4)  # steps 9-12: snapshot 5 would have 6 healthy steps, snapshot 10 has 2
    assert rollback.ring[0].healthy_after < 3
    nan_step(trainer)  # step 13: neither 10 (unconfirmed) nor 5 (poisoned) is good
    assert trainer.events("rollback")[0]["to_step"] == 0


def test_an_anomaly_after_confirmation_leaves_a_snapshot_good(tmp_path):
    trainer, _, _ = make(tmp_path)
    trainer.healthy(8)  # snapshot 5 confirmed by steps 6-8
    trainer.step_end(spike(), action="skip", skipped=True)  # step 9
    nan_step(trainer)  # step 10
    assert [e["to_step"] for e in trainer.events("rollback")] == [5]


def test_a_rollback_restores_the_newest_good_snapshot_skips_its_data_and_backs_off(tmp_path):
    trainer, rollback, manager = make(tmp_path, skip_margin=2)
    trainer.healthy(10)
    manager.save(trainer)
    draws_after_10 = (torch.rand(3), random.random())  # from the RNG state snapshot 10 holds
    trainer.healthy(5)
    manager.save(trainer)
    trainer.healthy(2)  # step 17: snapshot 15 has 2 of the 3 healthy steps it needs
    torch.rand(7)
    trainer.state.anomalies, trainer.state.transients = 4, {"node-3": 1}  # as the run counted
    manager.calls.clear()

    result = nan_step(trainer)  # step 18

    assert result.rolled_back and result.checkpoint_now
    assert (trainer.step, weight(trainer), trainer.state.samples_seen) == (10, 10, 10 * B)
    assert [s.step for s in rollback.ring] == [5, 10]  # 15 belonged to the abandoned steps
    assert torch.equal(torch.rand(3), draws_after_10[0])
    assert random.random() == draws_after_10[1]
    stream = trainer.loader.stream
    assert stream.cursor == 10 * B and stream.skip_windows == [(10 * B, 18 * B + 2)]
    assert stream.take(1) == [18 * B + 2]
    state = trainer.state
    # Counters of what happened survive the restore; the back-off is from the restored step.
    assert (state.rollbacks, state.anomalies, state.skipped_steps) == (1, 4, 1)
    assert state.transients == {"node-3": 1}
    assert (state.lr_scale, state.clip_scale, state.backoff_until) == (0.5, 0.5, 10 + 200)
    # An async checkpoint in flight commits first; the checkpoints after step 10 are retired.
    assert manager.calls == [("finish_pending",), ("retire_after", 10)]
    assert sorted(manager.saved) == [10]
    rollback_event, skip, backoff = trainer.events()
    assert {e["step"] for e in (rollback_event, skip, backoff)} == {18}  # the anomaly's step
    assert rollback_event["kind"] == "rollback" and rollback_event["from_step"] == 18
    assert (rollback_event["to_step"], rollback_event["source"]) == (10, "memory")
    assert (rollback_event["repeat"], rollback_event["rollbacks"]) == (False, 1)
    assert rollback_event["retired_checkpoints"] == ["step_00000015"]
    assert skip["kind"] == "skip_data"
    assert (skip["start"], skip["end"], skip["samples"]) == (40, 74, 34)
    assert backoff["kind"] == "lr_backoff"
    assert (backoff["factor"], backoff["lr_scale"], backoff["clip_scale"]) == (0.5, 0.5, 0.5)
    assert backoff["until_step"] == 210
    written = read_jsonl(trainer.run_dir.path / "events.jsonl")
    assert [(e["kind"], e["step"]) for e in written] == [
        ("rollback", 18),
        ("skip_data", 18),
        ("lr_backoff", 18),
    ]


@pytest.mark.parametrize(
    ("window", "repeat", "to_step", "skip_windows"),
    [(50, True, 5, [(20, 108)]), (5, False, 15, [(40, 72), (92, 108)])],
)
def test_a_repeat_within_the_window_goes_one_snapshot_further_back(
    tmp_path, window, repeat, to_step, skip_windows
):
    trainer, rollback, _ = make(tmp_path, window=window)
    trainer.healthy(17)
    nan_step(trainer)  # step 18 -> 10, skips [40, 72)
    trainer.healthy(8)  # steps 11-18 again: snapshot 15 of the new steps, confirmed
    nan_step(trainer)  # step 19, 9 steps after the restored step 10
    second = trainer.events("rollback")[-1]
    assert (second["from_step"], second["to_step"], second["repeat"]) == (19, to_step, repeat)
    assert trainer.step == to_step == weight(trainer)
    # The new window runs from the restored cursor to the anomaly's (9 steps after 72); the
    # first one is kept. Step 15 of the new steps ended at 72 + 5 * B.
    assert trainer.loader.stream.skip_windows == skip_windows
    assert (trainer.state.lr_scale, trainer.state.clip_scale) == (0.25, 0.25)  # compounding
    assert trainer.state.backoff_until == to_step + 200
    assert rollback.last == (to_step, 19)


def test_the_starting_state_is_the_target_early_and_again_on_a_different_step(tmp_path):
    trainer, rollback, _ = make(tmp_path)
    trainer.healthy(2)
    nan_step(trainer)  # step 3: no snapshot yet -> the state the run started from
    (first,) = trainer.events("rollback")
    assert (first["to_step"], first["source"], weight(trainer)) == (0, "memory", 0)
    assert trainer.loader.stream.skip_windows == [(0, 3 * B)] and not rollback.ring
    trainer.healthy(1)
    nan_step(trainer)  # step 2, a repeat: nothing before step 0, but the start is good
    second = trainer.events("rollback")[-1]
    assert (second["from_step"], second["to_step"], second["repeat"]) == (2, 0, True)
    assert trainer.loader.stream.skip_windows == [(0, 3 * B + 2 * B)]
    trainer.healthy(1)
    with pytest.raises(AbortRun, match="anomaly at step 2, again within 50 steps") as raised:
        nan_step(trainer)  # step 2 again: nothing the ladder changed helped
    assert raised.value.exit_code == 3
    assert "no good snapshot or checkpoint before step 0" in str(raised.value)
    assert trainer.events()[-1]["kind"] == "abort"


def test_more_rollbacks_than_max_rollbacks_abort_with_the_marker(tmp_path):
    trainer, _, manager = make(tmp_path, max_rollbacks=1, window=0)
    trainer.healthy(2)
    nan_step(trainer)  # step 3 -> 0: the one allowed
    trainer.healthy(3)
    manager.calls.clear()
    with pytest.raises(AbortRun) as raised:
        nan_step(trainer)  # step 4
    reason = "2 rollbacks by step 4 (resilience.max_rollbacks=1)"
    assert str(raised.value) == reason
    assert (trainer.run_dir.path / "ABORTED").read_text() == reason + "\n"
    abort = trainer.events()[-1]
    assert (abort["kind"], abort["step"], abort["reason"]) == ("abort", 4, reason)
    assert manager.calls == [("finish_pending",)]  # committed first, nothing restored
    assert trainer.step == 4


def test_without_snapshots_the_newest_verified_checkpoint_before_the_anomaly_is_loaded(tmp_path):
    trainer, rollback, manager = make(tmp_path, snapshot_every=0)
    trainer.healthy(10)
    manager.save(trainer)
    trainer.healthy(10)
    manager.save(trainer)
    manager.corrupt.add(20)
    trainer.healthy(4)
    manager.calls.clear()
    nan_step(trainer)  # step 25
    (event,) = trainer.events("rollback")
    assert (event["to_step"], event["source"]) == (10, "disk")
    assert event["retired_checkpoints"] == ["step_00000020"]
    assert manager.calls == [
        ("finish_pending",),
        ("verify", "step_00000020"),  # corrupt: skipped
        ("verify", "step_00000010"),
        ("load", "step_00000010"),
        ("retire_after", 10),
    ]
    assert (trainer.step, weight(trainer)) == (10, 10)
    assert trainer.loader.stream.skip_windows == [(10 * B, 25 * B)]
    trainer.healthy(3)
    with pytest.raises(AbortRun, match="no good snapshot or checkpoint before step 10"):
        nan_step(trainer)  # a repeat: checkpoint 10 is not before the last restored step


def test_a_zero_cooldown_backs_off_for_the_rest_of_the_run(tmp_path):
    trainer, _, _ = make(tmp_path, lr_cooldown_steps=0, lr_backoff=0.1, clip_backoff=0.8)
    trainer.healthy(2)
    nan_step(trainer)
    state = trainer.state
    assert (state.lr_scale, state.clip_scale, state.backoff_until) == (0.1, 0.8, -1)
    assert trainer.events("lr_backoff")[0]["until_step"] == -1


def test_the_guard_decides_before_rollback_acts(tmp_path):
    """Registered in the wrong order on purpose: priorities put the guard (1) first."""
    manager = StubManager(tmp_path / "checkpoints")
    rollback = Rollback(ResilienceConfig(**LADDER), manager)
    guard = AnomalyGuard(MonitorConfig(nonfinite="rollback", on_spike="warn"))
    trainer = StubTrainer(tmp_path / "run", [rollback, guard])
    trainer.callbacks.on_start(trainer)
    trainer.healthy(8)
    assert trainer.step_end(spike()).action == "warn" and trainer.step == 9
    result = trainer.step_end(nonfinite(), skipped=True)  # step 10
    assert result.action == "rollback" and result.rolled_back and trainer.step == 5
    assert [e["kind"] for e in trainer.events()] == [
        "anomaly",
        "anomaly",
        "rollback",
        "skip_data",
        "lr_backoff",
    ]


def test_a_checkpoint_after_a_rollback_never_writes_a_host_copy_of_the_abandoned_steps(tmp_path):
    trainer, _, _ = make(tmp_path)
    trainer.healthy(17)  # host copy of step 15
    nan_step(trainer)  # step 18 -> 10
    trainer.healthy(4)
    trainer.step_end(skipped=True)  # step 15 again, an FP16 overflow: no new snapshot
    copy = trainer.host_copy
    # CheckpointCallback.save writes copy.state when copy.step == trainer.step.
    if copy is not None and copy.step == trainer.step:
        assert torch.equal(copy.state["weight"], trainer.backend.weight)
