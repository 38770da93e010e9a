"""Verdicts on the monitor's numbers (bigtrain/resilience/detect.py): non-finite values and FP16
overflows, spikes by the configured rules, the tensors named in the report. The rules themselves
on recorded healthy traces: test_rules.py."""

from __future__ import annotations

import pytest
import torch

from bigtrain.config.schema import MonitorConfig
from bigtrain.monitor.monitor import GradMonitor
from bigtrain.resilience import Detector
from tests.monitor.test_monitor import NAMES, grads

pytestmark = pytest.mark.unit


def health(named=None, loss: float = 2.0, full: bool = True):
    m = GradMonitor(MonitorConfig(), NAMES, torch.device("cpu"), use_kernel=False)
    return m.check(named if named is not None else grads(), torch.tensor(loss), 1.0, full=full)


def fed(steps: int = 30, **monitor) -> Detector:
    """A detector whose windows hold `steps` healthy steps (loss slowly falling)."""
    detector = Detector(MonitorConfig(**monitor), NAMES)
    for i in range(steps):
        h = health(grads(seed=i), loss=3.0 - 0.01 * i)
        assert detector.verdict(h, loss_scaled=False).anomaly is None
        detector.add(h)
    return detector


def test_a_healthy_step_has_no_anomaly_and_is_applied():
    verdict = fed().verdict(health(grads(seed=99), loss=2.7), loss_scaled=False)
    assert verdict.anomaly is None and not verdict.skip and verdict.finite


def test_a_nan_gradient_is_a_nonfinite_anomaly_naming_the_poisoned_tensor():
    named = grads(seed=5)
    named[2][1][3, 3] = float("nan")
    detector, h = fed(), health(named, full=False)
    verdict = detector.verdict(h, loss_scaled=False)
    anomaly = verdict.anomaly
    assert (anomaly.kind, anomaly.metric, anomaly.value) == ("nonfinite", "grads", 1.0)
    assert verdict.skip and not verdict.finite
    detector.name_tensors(anomaly, h, max_abs=None)
    assert anomaly.tensor == "blocks.0.mlp.weight"
    assert anomaly.top_nonfinite == [["blocks.0.mlp.weight", 1]]
    assert anomaly.top_jumps[0][0] == "blocks.0.mlp.weight"  # NaN first


def test_nonfinite_gradients_under_loss_scaling_are_an_overflow_not_an_anomaly():
    named = grads()
    named[0][1][0, 0] = float("inf")
    verdict = fed().verdict(health(named), loss_scaled=True)
    assert verdict.overflow and verdict.skip and verdict.anomaly is None and not verdict.finite
    nan_loss = fed().verdict(health(grads(), loss=float("nan")), loss_scaled=True)
    assert not nan_loss.overflow and nan_loss.anomaly.metric == "loss"


@pytest.mark.parametrize("on_spike", ["rollback", "warn"])
def test_a_loss_spike_is_an_anomaly_and_never_joins_the_window(on_spike):
    detector = fed(on_spike=on_spike)
    window = list(detector.rules["loss"].values)
    verdict = detector.verdict(health(grads(seed=40), loss=8.0), loss_scaled=False)
    anomaly = verdict.anomaly
    assert (anomaly.kind, anomaly.metric, anomaly.value) == ("spike", "loss", 8.0)
    assert anomaly.baseline == pytest.approx(2.855, abs=0.01)  # median of the 30 losses
    assert anomaly.threshold == pytest.approx(1.5 * anomaly.baseline, rel=1e-6)
    assert [s["metric"] for s in anomaly.spikes] == ["loss"]
    assert verdict.skip == (on_spike == "rollback") and verdict.warn_only == (on_spike == "warn")
    assert list(detector.rules["loss"].values) == window  # the loop adds healthy steps only


def test_a_gradient_norm_far_above_its_history_spikes_and_names_the_tensor_that_jumped():
    detector = fed()
    named = grads(seed=41)
    named[1] = (named[1][0], named[1][1] * 1e4)  # one tensor's gradient x 10^4
    h = health(named)
    anomaly = detector.verdict(h, loss_scaled=False).anomaly
    assert (anomaly.kind, anomaly.metric) == ("spike", "grad_norm")
    detector.name_tensors(anomaly, h, h.host_max_abs)
    assert anomaly.tensor == "blocks.0.attn.weight" and anomaly.top_jumps[0][1] > 1e3
    assert anomaly.top_max_abs[0][0] == "blocks.0.attn.weight"


def test_rules_can_be_switched_off_and_the_windows_round_trip():
    assert fed(rules=[]).verdict(health(loss=80.0), loss_scaled=False).anomaly is None
    detector, again = fed(), Detector(MonitorConfig(), NAMES)
    again.load_state_dict(detector.state_dict())
    assert list(again.rules["loss"].values) == list(detector.rules["loss"].values)
    assert len(again.tensors.norms) == len(detector.tensors.norms) == 20
    again.load_state_dict({"loss": {"values": [1.0]}})  # an earlier bigtrain's windows: none
    assert not again.rules["loss"].values
