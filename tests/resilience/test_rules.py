"""The spike rules against healthy runs and injected faults. traces/ holds per-step loss and
gradient norm of 6 healthy configs/tiny.yaml runs of bench/detection.py's sweep (GPT-2 and Llama
style, FP32 and BF16, Shakespeare and the standard library's source, LR 3e-3 and 6e-3; written by
`python bench/detection.py --runs 6 --validate 0 --save-fixtures tests/resilience/traces`)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from bigtrain.config.schema import MonitorConfig
from bigtrain.monitor.monitor import Health
from bigtrain.resilience.detect import Detector
from bigtrain.resilience.rules import SpikeRule, TensorHistory

pytestmark = pytest.mark.unit

TRACES = sorted((Path(__file__).parent / "traces").glob("*.json"))
FAULT_STEPS = (2, 3, 10, 21, 50, 120, 299)


def load(path: Path) -> tuple[list[float], list[float]]:
    data = json.loads(path.read_text())
    return data["loss"], data["grad_norm"]


def health(loss: float, grad_norm: float) -> Health:
    """The host values the Detector reads (no per-tensor statistics: Detector(names=[]))."""
    return Health(
        None,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        host_loss=loss,
        host_grad_norm=grad_norm,
        num_nonfinite=0,
        host_sum_sq=[],
        host_nonfinite=[],
        host_max_abs=None,
        replicas=[],
        telemetry={},
    )


def replay(loss: list[float], grad_norm: list[float], cfg: MonitorConfig) -> dict[int, str]:
    """The run step by step as the healer does it (verdict, then healthy values join the
    windows): {step: the anomaly's metric}."""
    detector, found = Detector(cfg, names=[]), {}
    for step, (value, norm) in enumerate(zip(loss, grad_norm, strict=True), start=1):
        anomaly = detector.verdict(health(value, norm), loss_scaled=False).anomaly
        if anomaly is None:
            detector.add(health(value, norm))
        else:
            found[step] = anomaly.metric
    return found


def with_fault(series: list[float], step: int, value: float) -> list[float]:
    """The series up to `step`, whose value is replaced (the steps after it need not run)."""
    return series[: step - 1] + [value]


def test_the_fixtures_are_the_sweeps_six_runs():
    assert len(TRACES) == 6
    runs = [json.loads(p.read_text())["run"] for p in TRACES]
    for factor in ("precision", "style", "corpus", "lr_mult"):
        assert len({r[factor] for r in runs}) == 2, factor
    assert all(len(load(p)[0]) == 300 for p in TRACES)


@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.stem)
def test_healthy_runs_raise_no_alarm(path):
    assert replay(*load(path), MonitorConfig()) == {}


@pytest.mark.parametrize("factor", [10, 50])
@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.stem)
def test_a_loss_spike_on_one_rank_of_two_is_caught_at_its_step(path, factor):
    loss, grad_norm = load(path)
    for step in FAULT_STEPS:
        # One rank's loss x factor, the other's unchanged: the mean over 2 ranks is (f + 1) / 2 x.
        spiked = with_fault(loss, step, loss[step - 1] * (factor + 1) / 2)
        found = replay(spiked, grad_norm[:step], MonitorConfig())
        assert found == {step: "loss"}, (step, found)


@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.stem)
def test_a_nan_loss_is_caught_at_its_step(path):
    loss, grad_norm = load(path)
    for step in FAULT_STEPS:
        found = replay(with_fault(loss, step, math.nan), grad_norm[:step], MonitorConfig())
        assert found == {step: "loss"}, step


@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.stem)
def test_the_grad_norm_rule_alone_raises_no_alarm(path):
    assert replay(*load(path), MonitorConfig(rules=["grad_norm"])) == {}


# Measured on these traces: once min_values are known, 12 robust sigmas of a noisy warm-up's log
# norms lift the grad_norm threshold past 2000x the median, at steps 32-52 of
# tiny-gpt2-bf16-shakespeare-lr2x-s1 (21863x at step 47) and 47 and 49 of
# tiny-gpt2-fp32-shakespeare-lr1x-s1 (2233x). Reported, not tuned here.
@pytest.mark.parametrize("step", FAULT_STEPS)
@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.stem)
def test_the_grad_norm_rule_fires_on_a_2000x_norm(path, step):
    loss, grad_norm = load(path)
    typical = float(np.median(grad_norm[max(0, step - 51) : step - 1]))  # the last 50 values
    spiked = with_fault(grad_norm, step, typical * 2000)
    found = replay(loss[:step], spiked, MonitorConfig(rules=["grad_norm"]))
    assert found == {step: "grad_norm"}


# --- SpikeRule ----------------------------------------------------------------------------------


def rule(values: list[float], **settings) -> SpikeRule:
    made = SpikeRule(
        "loss", **{"window": 50, "factor": 1.5, "sigmas": 6.0, "min_values": 10, **settings}
    )
    for value in values:
        made.add(value)
    return made


def test_the_factor_alone_decides_before_min_values():
    spiky = rule([2.0] * 9)
    assert spiky.threshold() == pytest.approx((2.0, 3.0))
    assert spiky.check(2.99) is None
    found = spiky.check(3.01)
    assert (found.value, found.threshold, found.baseline) == pytest.approx((3.01, 3.0, 2.0))


def test_a_noisy_series_widens_the_threshold_from_min_values_on():
    noisy = [1.0, 4.0] * 10  # log values 0 and log 4: MAD log 2, baseline 2
    before = rule(noisy[:4])
    assert before.check(100.0) is not None  # 1.5 x 2 = 3 decides with 4 values
    after = rule(noisy)
    baseline, threshold = after.threshold()
    assert baseline == pytest.approx(2.0)
    assert threshold == pytest.approx(2.0 * math.exp(6 * 1.4826 * math.log(2)))
    assert after.check(100.0) is None


def test_the_window_keeps_the_last_values_and_survives_a_round_trip():
    original = rule([float(v) for v in range(1, 61)])
    assert list(original.values) == [float(v) for v in range(11, 61)]
    restored = rule([])
    restored.load_state_dict(json.loads(json.dumps(original.state_dict())))
    assert list(restored.values) == list(original.values)
    assert restored.threshold() == original.threshold()


def test_non_finite_and_non_positive_values_never_join_the_window():
    spiky = rule([2.0] * 3)
    for value in (math.nan, math.inf, -math.inf, 0.0, -1.0):
        spiky.add(value)
        assert spiky.check(value) is None  # non-finite values are the NaN check's
    assert list(spiky.values) == [2.0] * 3


def test_no_threshold_before_the_first_value():
    assert rule([]).threshold() is None
    assert rule([]).check(1e9) is None


# --- TensorHistory ------------------------------------------------------------------------------


def test_jumps_name_the_tensor_that_jumped_nan_first():
    history = TensorHistory(["a", "b", "c"], window=4)
    assert history.jumps([1.0, 1.0, 1.0], k=3) == []  # no history yet
    for sum_sq in ([1.0, 4.0, 9.0], [1.0, 4.0, 9.0], [math.nan, 4.0, 9.0]):
        history.add(sum_sq)  # the non-finite step stays out
    assert len(history.norms) == 2
    assert history.jumps([1.0, 400.0, 9.0], k=2) == [["b", pytest.approx(10.0)], ["a", 1.0]]
    jumps = history.jumps([math.nan, 400.0, 9.0], k=3)
    assert [name for name, _ in jumps] == ["a", "b", "c"]
    assert jumps[0][1] == math.inf and np.isclose(jumps[1][1], 10.0)
