"""The anomaly guard on a stub trainer: the action per anomaly kind and setting, the stop after
anomalies in a row, FP16 overflows, the events and the ABORTED marker."""

from __future__ import annotations

import pytest

from bigtrain.callbacks.guard import AnomalyGuard
from bigtrain.config.schema import MonitorConfig
from bigtrain.errors import AbortRun
from bigtrain.precision.scaler import ScaleUpdate
from tests.stubs import StubTrainer, nonfinite, spike

pytestmark = pytest.mark.unit


def make(tmp_path, rank: int = 0, **monitor) -> tuple[StubTrainer, AnomalyGuard]:
    guard = AnomalyGuard(MonitorConfig(**monitor))
    return StubTrainer(tmp_path, [guard], rank=rank), guard


@pytest.mark.parametrize(
    ("nonfinite_setting", "on_spike", "nonfinite_action", "spike_action"),
    [
        ("rollback", "rollback", "rollback", "rollback"),
        ("skip", "warn", "skip", "warn"),
        ("rollback", "skip", "rollback", "skip"),
        ("skip", "rollback", "skip", "rollback"),
    ],
)
def test_each_kind_takes_its_own_setting(
    tmp_path, nonfinite_setting, on_spike, nonfinite_action, spike_action
):
    trainer, _ = make(tmp_path, nonfinite=nonfinite_setting, on_spike=on_spike)
    assert trainer.step_end(nonfinite(), skipped=True).action == nonfinite_action
    assert trainer.step_end(spike()).action == spike_action
    assert trainer.step_end().action is None  # a healthy step has no action
    assert [(e["step"], e["type"], e["action"]) for e in trainer.events("anomaly")] == [
        (1, "nonfinite", nonfinite_action),
        (2, "spike", spike_action),
    ]
    assert trainer.state.anomalies == 2


def test_the_anomaly_event_carries_the_monitors_details(tmp_path):
    trainer, _ = make(tmp_path, on_spike="skip")
    trainer.step_end(spike("grad_norm"), skipped=True)
    (event,) = trainer.events()
    assert event["kind"] == "anomaly" and event["metric"] == "grad_norm"
    assert (event["value"], event["threshold"], event["baseline"]) == (50.0, 5.0, 2.0)
    assert event["action"] == "skip"


def test_nonfinite_abort_writes_the_event_the_marker_and_exits_3(tmp_path):
    trainer, _ = make(tmp_path, nonfinite="abort", on_spike="warn")
    assert trainer.step_end(spike()).action == "warn"  # spikes keep their own setting
    with pytest.raises(AbortRun) as raised:
        trainer.step_end(nonfinite("loss"), skipped=True)
    reason = "non-finite loss at step 2 (monitor.nonfinite=abort)"
    assert str(raised.value) == reason and raised.value.exit_code == 3
    assert (tmp_path / "ABORTED").read_text() == reason + "\n"
    anomaly, abort = trainer.events()[1:]
    assert (anomaly["kind"], anomaly["action"], anomaly["step"]) == ("anomaly", "abort", 2)
    assert (abort["kind"], abort["reason"], abort["step"]) == ("abort", reason, 2)


def test_only_rank_0_writes_the_aborted_marker(tmp_path):
    trainer, _ = make(tmp_path, rank=1, nonfinite="abort")
    with pytest.raises(AbortRun):
        trainer.step_end(nonfinite(), skipped=True)
    assert not (tmp_path / "ABORTED").exists()
    assert [e["kind"] for e in trainer.events()] == ["anomaly", "abort"]  # heard on every rank


def test_max_consecutive_anomalies_abort_and_a_healthy_step_resets_the_count(tmp_path):
    trainer, guard = make(tmp_path, max_consecutive=3, nonfinite="skip", on_spike="warn")
    trainer.step_end(spike())
    trainer.step_end(nonfinite(), skipped=True)
    trainer.step_end()  # step 3: healthy, the count starts over
    assert guard.consecutive == 0
    trainer.step_end(spike())
    assert trainer.step_end(nonfinite(), skipped=True).action == "skip"
    with pytest.raises(AbortRun) as raised:
        trainer.step_end(spike())  # step 6: the third in a row
    reason = "3 anomalous steps in a row up to step 6 (monitor.max_consecutive=3)"
    assert str(raised.value) == reason
    assert (tmp_path / "ABORTED").read_text() == reason + "\n"
    last_anomaly = trainer.events("anomaly")[-1]
    assert (last_anomaly["step"], last_anomaly["action"]) == (6, "abort")
    assert trainer.state.anomalies == 5


@pytest.mark.parametrize(("changed", "scale_change"), [("backoff", "backoff"), ("", "none")])
def test_an_overflow_is_an_event_not_an_anomaly(tmp_path, changed, scale_change):
    trainer, guard = make(tmp_path, max_consecutive=2, on_spike="warn")
    trainer.step_end(spike())
    update = ScaleUpdate(512.0, True, changed=changed)
    result = trainer.step_end(overflow=True, scale_update=update, skipped=True)
    assert result.action is None and guard.consecutive == 0  # the overflow ended the run of two
    trainer.step_end(spike())  # not the second in a row: no abort
    overflow = trainer.events("overflow")
    assert [(e["step"], e["loss_scale"], e["scale_change"]) for e in overflow] == [
        (2, 512.0, scale_change)
    ]
    assert trainer.state.anomalies == 2
