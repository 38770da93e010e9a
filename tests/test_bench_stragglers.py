"""bench/stragglers.py's scoring on recorded times it did not run: false alarms counted per timing
step, slow runs named, the rule before issue 49 beside the configured one."""

from __future__ import annotations

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.unit


def parts(forward_backward: float, optimizer: float = 0.01) -> dict[str, float]:
    return {
        "data": 0.001,
        "forward_backward": forward_backward,
        "sync": 0.0,
        "optimizer": optimizer,
        "other": 0.001,
    }


def timings(*pairs: tuple[dict, dict]) -> list[dict]:
    return [{"step": 2 * (i + 1), "by_rank": list(pair)} for i, pair in enumerate(pairs)]


def test_the_bench_counts_false_alarms_and_slow_runs_named(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import stragglers

    even = (parts(0.3), parts(0.31))
    stall = (parts(0.3), parts(0.3, optimizer=0.2))  # one timing step: 0.19 s more, 40% of it
    healthy = [
        stragglers.Run("calm", 1.0, 0.0, timings(even, even, even)),
        stragglers.Run("stalled once", 1.0, 0.0, timings(even, stall, even)),
    ]
    slow_pair = (parts(0.323), parts(0.517))  # the step 50: 1.6x
    slow = [stragglers.Run("slow", 1.5, 0.2, timings(slow_pair, slow_pair, slow_pair))]
    assert stragglers.realised_ratio(slow[0]) == pytest.approx(0.517 / 0.323)

    configured = stragglers.score(healthy, slow, stragglers.Rule(1.3))  # 2 in a row
    assert configured["false_alarm_steps"] == 0
    assert configured["runs_named_x1.5"] == 1 and configured["first_timing_step_x1.5"] == [2]
    assert configured["detected_x1.5"] == pytest.approx(2 / 3, abs=0.001)
    one_step = stragglers.score(healthy, slow, stragglers.Rule(1.3, consecutive=1))
    assert one_step["false_alarm_steps"] == 1 and one_step["healthy_runs_with_alarm"] == 1
    assert one_step["false_alarms_per_1k"] == pytest.approx(1000 / 6, abs=0.01)
    before = stragglers.score(healthy, slow, stragglers.Rule(1.3, 0.0, 1, with_self=True))
    assert before["runs_named_x1.5"] == 0  # 1.6x never passes 1.3x the mean of the two
