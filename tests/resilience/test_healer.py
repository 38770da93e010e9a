"""The healer's state machine step by step on a stub trainer (tests/stubs.py): the action per
anomaly kind and setting, which targets exist and count as good, what a rollback restores, skips
and backs off, when it goes further back, rebuilds a target it does not hold, and gives up. The
whole ladder in real runs: tests/resilience/test_recovery.py, tests/callbacks/test_rollback.py."""

from __future__ import annotations

import random

import pytest
import torch

from bigtrain.errors import AbortRun
from bigtrain.precision.scaler import ScaleUpdate
from bigtrain.store.rundir import read_jsonl
from tests.stubs import GLOBAL_BATCH as B
from tests.stubs import StubManager, StubTrainer, nonfinite, spike, stub_healer

pytestmark = pytest.mark.unit

LADDER = {"snapshot_every": 5, "snapshots": 3, "confirm_steps": 3, "lr_cooldown_steps": 200}


def make(tmp_path, monitor=None, checkpoint_every=0, rank=0, resumed=False, **resilience):
    manager = StubManager(tmp_path / "checkpoints")
    healer = stub_healer(manager, monitor, checkpoint_every, **{**LADDER, **resilience})
    trainer = StubTrainer(tmp_path / "run", rank=rank, healer=healer)
    healer.start(resumed)
    return trainer, healer, manager


def nan_step(trainer: StubTrainer):
    """A non-finite step as the loop ends it: not applied."""
    return trainer.step_end(nonfinite(), skipped=True)


def weight(trainer: StubTrainer) -> float:
    """The backend's weight: the number of updates applied to the state it holds."""
    return trainer.backend.weight[0].item()


def ring(healer) -> list[tuple[int, int, bool]]:
    return [(t.step, t.healthy_after, t.held is not None) for t in healer.targets.ring]


# --- actions -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("nonfinite_setting", "on_spike", "nonfinite_action", "spike_action"),
    [("skip", "warn", "skip", "warn"), ("skip", "skip", "skip", "skip")],
)
def test_each_kind_takes_its_own_setting(
    tmp_path, nonfinite_setting, on_spike, nonfinite_action, spike_action
):
    trainer, _, _ = make(tmp_path, {"nonfinite": nonfinite_setting, "on_spike": on_spike})
    assert trainer.step_end(nonfinite(), skipped=True).action == nonfinite_action
    assert trainer.step_end(spike()).action == spike_action
    assert trainer.step_end().action is None  # a healthy step has no action
    assert [(e["step"], e["type"], e["action"]) for e in trainer.events("anomaly")] == [
        (1, "nonfinite", nonfinite_action),
        (2, "spike", spike_action),
    ]
    assert trainer.state.anomalies == 2


def test_the_anomaly_event_carries_the_detectors_details(tmp_path):
    trainer, _, _ = make(tmp_path, {"on_spike": "skip"})
    trainer.step_end(spike("grad_norm"), skipped=True)
    (event,) = trainer.events()
    assert event["kind"] == "anomaly" and event["metric"] == "grad_norm"
    assert (event["value"], event["threshold"], event["baseline"]) == (50.0, 5.0, 2.0)
    assert event["action"] == "skip"


def test_nonfinite_abort_writes_the_event_the_marker_and_exits_3(tmp_path):
    trainer, _, _ = make(tmp_path, {"nonfinite": "abort", "on_spike": "warn"})
    assert trainer.step_end(spike()).action == "warn"  # spikes keep their own setting
    with pytest.raises(AbortRun) as raised:
        trainer.step_end(nonfinite("loss"), skipped=True)
    reason = "non-finite loss at step 2 (monitor.nonfinite=abort)"
    assert str(raised.value) == reason and raised.value.exit_code == 3
    assert (trainer.run_dir.path / "ABORTED").read_text() == reason + "\n"
    anomaly, abort = trainer.events()[1:]
    assert (anomaly["kind"], anomaly["action"], anomaly["step"]) == ("anomaly", "abort", 2)
    assert (abort["kind"], abort["reason"], abort["step"]) == ("abort", reason, 2)


def test_only_rank_0_writes_the_aborted_marker(tmp_path):
    trainer, _, _ = make(tmp_path, {"nonfinite": "abort"}, rank=1)
    with pytest.raises(AbortRun):
        nan_step(trainer)
    assert not (trainer.run_dir.path / "ABORTED").exists()
    assert [e["kind"] for e in trainer.events()] == ["anomaly", "abort"]  # heard on every rank


def test_max_consecutive_anomalies_abort_and_a_healthy_step_resets_the_count(tmp_path):
    monitor = {"max_consecutive": 3, "nonfinite": "skip", "on_spike": "warn"}
    trainer, healer, _ = make(tmp_path, monitor)
    trainer.step_end(spike())
    nan_step(trainer)
    trainer.step_end()  # step 3: healthy, the count starts over
    assert healer.consecutive == 0
    trainer.step_end(spike())
    assert nan_step(trainer).action == "skip"
    with pytest.raises(AbortRun) as raised:
        trainer.step_end(spike())  # step 6: the third in a row
    reason = "3 anomalous steps in a row up to step 6 (monitor.max_consecutive=3)"
    assert str(raised.value) == reason
    last_anomaly = trainer.events("anomaly")[-1]
    assert (last_anomaly["step"], last_anomaly["action"]) == (6, "abort")
    assert trainer.state.anomalies == 5


@pytest.mark.parametrize(("changed", "scale_change"), [("backoff", "backoff"), ("", "none")])
def test_an_overflow_is_an_event_not_an_anomaly(tmp_path, changed, scale_change):
    trainer, healer, _ = make(tmp_path, {"max_consecutive": 2, "on_spike": "warn"})
    trainer.step_end(spike())
    update = ScaleUpdate(512.0, True, changed=changed)
    result = trainer.step_end(overflow=True, scale_update=update, skipped=True)
    assert result.action is None and healer.consecutive == 0  # the overflow ended the run of two
    trainer.step_end(spike())  # not the second in a row: no abort
    overflow = trainer.events("overflow")
    assert [(e["step"], e["loss_scale"], e["scale_change"]) for e in overflow] == [
        (2, 512.0, scale_change)
    ]
    assert trainer.state.anomalies == 2


# --- targets -------------------------------------------------------------------------------------


def test_targets_every_n_steps_skip_skipped_steps_and_keep_the_newest(tmp_path):
    trainer, healer, _ = make(tmp_path)
    start = healer.targets.start
    assert (start.step, start.good(3), start.held is not None) == (0, True, True)  # by definition
    trainer.healthy(9)
    trainer.step_end(skipped=True)  # step 10 was not applied: no target of it
    trainer.healthy(15)
    assert ring(healer) == [(15, 10, True), (20, 5, True), (25, 0, True)]  # 5 left the ring of 3
    newest = healer.targets.ring[-1]
    assert newest.held.backend_state["weight"].tolist() == [24.0] * 3  # 25 steps, one skipped
    assert newest.held.parts["data"]["cursor"] == newest.cursor == 25 * B
    assert newest.held.parts["state"]["skipped_steps"] == 1
    # A checkpoint of step 25 writes from this copy instead of copying again; of 24, not.
    assert healer.host_state() is newest.held.backend_state
    trainer.step_end(skipped=True)  # step 26: no target
    assert healer.host_state() is None


def test_checkpoint_steps_are_targets_too_and_without_snapshots_nothing_is_held(tmp_path):
    trainer, healer, _ = make(tmp_path, checkpoint_every=4, snapshot_every=0)
    trainer.healthy(9)
    assert ring(healer) == [(4, 5, False), (8, 1, False)]
    assert healer.targets.start.held is None and healer.host_state() is None


@pytest.mark.parametrize(("healthy_after_snapshot", "to_step"), [(2, 0), (3, 5)])
def test_a_target_is_good_once_confirm_steps_healthy_steps_followed_it(
    tmp_path, healthy_after_snapshot, to_step
):
    trainer, _, _ = make(tmp_path)
    trainer.healthy(5 + healthy_after_snapshot)
    nan_step(trainer)
    (event,) = trainer.events("rollback")
    assert (event["to_step"], trainer.step, weight(trainer)) == (to_step, to_step, to_step)


def test_an_anomaly_before_confirmation_poisons_a_target_for_good(tmp_path):
    trainer, healer, _ = make(tmp_path, {"on_spike": "warn"})
    trainer.healthy(7)  # target 5 and two healthy steps after it, one short of confirmed
    trainer.step_end(spike())  # step 8: applied, no rollback
    assert not trainer.events("rollback") and weight(trainer) == 8
    trainer.healthy(4)  # steps 9-12: target 5 would have 6 healthy steps, target 10 has 2
    assert healer.targets.ring[0].healthy_after < 3
    nan_step(trainer)  # step 13: neither 10 (unconfirmed) nor 5 (poisoned) is good
    assert trainer.events("rollback")[0]["to_step"] == 0


def test_an_anomaly_after_confirmation_leaves_a_target_good(tmp_path):
    trainer, _, _ = make(tmp_path, {"on_spike": "skip"})
    trainer.healthy(8)  # target 5 confirmed by steps 6-8
    trainer.step_end(spike(), skipped=True)  # step 9
    nan_step(trainer)  # step 10
    assert [e["to_step"] for e in trainer.events("rollback")] == [5]


# --- rollbacks -----------------------------------------------------------------------------------


def test_a_rollback_restores_the_newest_good_target_skips_its_data_and_backs_off(tmp_path):
    trainer, healer, manager = make(tmp_path, skip_margin=2)
    trainer.healthy(10)
    manager.save(trainer)
    draws_after_10 = (torch.rand(3), random.random())  # from the RNG state target 10 holds
    trainer.healthy(5)
    manager.save(trainer)
    trainer.healthy(2)  # step 17: target 15 has 2 of the 3 healthy steps it needs
    torch.rand(7)
    trainer.state.anomalies, trainer.state.transients = 4, {"node-3": 1}  # as the run counted
    manager.calls.clear()

    result = nan_step(trainer)  # step 18

    assert result.rolled_back and result.checkpoint_now and result.action == "rollback"
    assert (trainer.step, weight(trainer), trainer.state.samples_seen) == (10, 10, 10 * B)
    assert [t.step for t in healer.targets.ring] == [5, 10]  # 15 belonged to the abandoned steps
    assert torch.equal(torch.rand(3), draws_after_10[0])
    assert random.random() == draws_after_10[1]
    stream = trainer.loader.stream
    assert stream.cursor == 10 * B and stream.skip_windows == [(10 * B, 18 * B + 2)]
    assert stream.take(1) == [18 * B + 2]
    state = trainer.state
    # Counters of what happened survive the restore; the back-off is from the restored step.
    assert (state.rollbacks, state.anomalies, state.skipped_steps) == (1, 5, 1)
    assert state.transients == {"node-3": 1}
    assert (state.lr_scale, state.clip_scale, state.backoff_until) == (0.5, 0.5, 10 + 200)
    # An async checkpoint in flight commits first; the checkpoints after step 10 are retired.
    assert manager.calls == [("finish_pending",), ("retire_after", 10)]
    assert sorted(manager.saved) == [10]
    rollback_event, skip, backoff = trainer.events()[1:]
    assert {e["step"] for e in (rollback_event, skip, backoff)} == {18}  # the anomaly's step
    assert rollback_event["kind"] == "rollback" and rollback_event["from_step"] == 18
    assert (rollback_event["to_step"], rollback_event["source"]) == (10, "memory")
    assert (rollback_event["repeat"], rollback_event["rollbacks"]) == (False, 1)
    assert (rollback_event["retired_checkpoints"], rollback_event["replay_steps"]) == (
        ["step_00000015"],
        0,
    )
    assert (skip["kind"], skip["start"], skip["end"], skip["samples"]) == ("skip_data", 40, 74, 34)
    assert backoff["kind"] == "lr_backoff"
    assert (backoff["factor"], backoff["lr_scale"], backoff["clip_scale"]) == (0.5, 0.5, 0.5)
    assert backoff["until_step"] == 210
    written = read_jsonl(trainer.run_dir.path / "events.jsonl")
    assert [(e["kind"], e["step"]) for e in written] == [
        ("anomaly", 18),
        ("rollback", 18),
        ("skip_data", 18),
        ("lr_backoff", 18),
    ]


@pytest.mark.parametrize(
    ("window", "repeat", "to_step", "skip_windows"),
    [(50, True, 5, [(20, 108)]), (5, False, 15, [(40, 72), (92, 108)])],
)
def test_a_repeat_within_the_window_goes_one_target_further_back(
    tmp_path, window, repeat, to_step, skip_windows
):
    trainer, healer, _ = make(tmp_path, window=window)
    trainer.healthy(17)
    nan_step(trainer)  # step 18 -> 10, skips [40, 72)
    trainer.healthy(8)  # steps 11-18 again: target 15 of the new steps, confirmed
    nan_step(trainer)  # step 19, 9 steps after the restored step 10
    second = trainer.events("rollback")[-1]
    assert (second["from_step"], second["to_step"], second["repeat"]) == (19, to_step, repeat)
    assert trainer.step == to_step == weight(trainer)
    # The new window runs from the restored cursor to the anomaly's (9 steps after 72); the
    # first one is kept. Step 15 of the new steps ended at 72 + 5 * B.
    assert trainer.loader.stream.skip_windows == skip_windows
    assert (trainer.state.lr_scale, trainer.state.clip_scale) == (0.25, 0.25)  # compounding
    assert trainer.state.backoff_until == to_step + 200
    assert healer.last == (to_step, 19)


def test_the_start_is_the_target_early_and_again_on_a_different_step(tmp_path):
    trainer, healer, _ = make(tmp_path)
    trainer.healthy(2)
    nan_step(trainer)  # step 3: no target yet but the state the run started from
    (first,) = trainer.events("rollback")
    assert (first["to_step"], first["source"], weight(trainer)) == (0, "memory", 0)
    assert trainer.loader.stream.skip_windows == [(0, 3 * B)] and not healer.targets.ring
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


def test_without_snapshots_a_target_is_read_from_its_checkpoint(tmp_path):
    trainer, _, manager = make(tmp_path, checkpoint_every=10, snapshot_every=0, confirm_steps=5)
    trainer.healthy(10)
    manager.save(trainer)
    trainer.healthy(10)
    manager.save(trainer)
    trainer.healthy(4)
    manager.calls.clear()
    nan_step(trainer)  # step 25: target 20 has 4 of its 5 healthy steps
    (event,) = trainer.events("rollback")
    assert (event["to_step"], event["source"]) == (10, "checkpoint")
    assert event["retired_checkpoints"] == ["step_00000020"]
    assert manager.calls == [
        ("finish_pending",),
        ("verify", "step_00000010"),
        ("load", "step_00000010"),
        ("retire_after", 10),
    ]
    assert (trainer.step, weight(trainer)) == (10, 10)
    assert trainer.loader.stream.skip_windows == [(10 * B, 25 * B)]


def test_a_target_whose_checkpoint_is_corrupt_is_rebuilt_from_the_one_before(tmp_path):
    trainer, _, manager = make(tmp_path, checkpoint_every=10, snapshot_every=0)
    trainer.healthy(10)
    manager.save(trainer)
    trainer.healthy(10)
    manager.save(trainer)
    manager.corrupt.add(20)
    trainer.healthy(4)
    nan_step(trainer)  # step 25: target 20 is good, its checkpoint fails its sha256
    (event,) = trainer.events("rollback")
    assert (event["to_step"], event["source"], event["replay_steps"]) == (
        20,
        "replay from checkpoint",
        10,
    )
    assert (trainer.step, weight(trainer)) == (10, 10)
    trainer.healthy(10)
    assert [e["to_step"] for e in trainer.events("rebuilt")] == [20]


def test_a_target_held_by_nobody_is_rebuilt_from_an_earlier_checkpoint(tmp_path):
    """Target 15 is neither held (snapshots went with a restart) nor checkpointed: checkpoint 10
    is loaded and the steps to 15 trained again; the back-off starts on reaching 15."""
    trainer, healer, manager = make(tmp_path, lr_cooldown_steps=None)
    trainer.healthy(10)
    manager.save(trainer)
    trainer.healthy(9)  # step 19: target 15 confirmed
    for target in healer.targets.ring:
        target.held = None  # as after a restart
    healer.targets.start.held = None
    nan_step(trainer)  # step 20
    (event,) = trainer.events("rollback")
    assert (event["to_step"], event["source"], event["replay_steps"]) == (
        15,
        "replay from checkpoint",
        5,
    )
    assert (trainer.step, weight(trainer), trainer.state.lr_scale) == (10, 10, 1.0)
    assert trainer.loader.stream.skip_windows == [(15 * B, 20 * B)]  # from target 15's cursor
    trainer.healthy(4)
    assert trainer.state.lr_scale == 1.0 and not trainer.events("rebuilt")
    trainer.healthy(1)  # step 15 reached: the target's state, and now the back-off
    (rebuilt,) = trainer.events("rebuilt")
    assert (rebuilt["to_step"], rebuilt["from_step"], rebuilt["replayed_steps"]) == (15, 10, 5)
    state = trainer.state
    assert (state.lr_scale, state.clip_scale, state.backoff_until) == (0.5, 0.5, 15 + 2 * 5)
    assert ring(healer)[-1] == (15, healer.targets.ring[-1].healthy_after, True)
    assert trainer.loader.stream.cursor == 15 * B  # it never entered the skipped data


def test_the_start_is_rebuilt_when_nothing_holds_it(tmp_path):
    trainer, healer, _ = make(tmp_path, snapshot_every=0)
    healer.recovery.start_weights = lambda: trainer.backend.weight.zero_()
    trainer.healthy(4)
    nan_step(trainer)  # step 5
    (event,) = trainer.events("rollback")
    assert (event["to_step"], event["source"]) == (0, "start")
    assert (trainer.step, weight(trainer), trainer.loader.stream.cursor) == (0, 0, 0)


def test_a_resumed_run_has_the_targets_and_start_of_the_straight_run(tmp_path):
    trainer, healer, manager = make(tmp_path)
    trainer.healthy(12)
    saved = trainer.run.state_dict()  # a checkpoint of step 12, as a stop writes it
    resumed, again, _ = make(tmp_path / "resumed", resumed=True)
    resumed.run.load_state_dict(saved)
    resumed.backend.weight.fill_(12)
    again.start(resumed=True)
    assert ring(again) == [(5, 7, False), (10, 2, False)]  # what the straight run knows, unheld
    assert again.origin == healer.origin and again.targets.start.step == 0


def test_a_zero_cooldown_backs_off_for_the_rest_of_the_run(tmp_path):
    trainer, _, _ = make(tmp_path, lr_cooldown_steps=0, lr_backoff=0.1, clip_backoff=0.8)
    trainer.healthy(2)
    nan_step(trainer)
    state = trainer.state
    assert (state.lr_scale, state.clip_scale, state.backoff_until) == (0.1, 0.8, -1)
    assert trainer.events("lr_backoff")[0]["until_step"] == -1


def test_the_default_cooldown_is_twice_the_steps_rolled_back_and_ends_with_the_run(tmp_path):
    trainer, healer, _ = make(tmp_path, lr_cooldown_steps=None)
    trainer.healthy(8)
    nan_step(trainer)  # step 9 -> 5: back off until 5 + 2 * 4
    assert trainer.state.backoff_until == 13
    healer.max_steps = 20
    trainer.healthy(14)  # steps 6-19; lr_restore at the start of step 14
    assert [e["step"] for e in trainer.events("lr_restore")] == [13]
    trainer.healthy(1)  # target 20 (confirmation pending), 15 confirmed at 18
    nan_step(trainer)  # step 21 -> 15 with a cooldown of 12: capped at max_steps
    assert trainer.state.backoff_until == 20
