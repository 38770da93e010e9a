"""The loss scaler's arithmetic step by step: growth after clean steps, back-off on overflows with
hysteresis, the minimum, static scaling, the state a checkpoint keeps. Overflows across ranks in
real runs: tests/precision/test_engine.py."""

from __future__ import annotations

import pytest

from bigtrain.config.schema import PrecisionConfig
from bigtrain.precision.scaler import LossScaler, ScaleUpdate

pytestmark = pytest.mark.unit


def scaler(
    scale: float = 8.0, growth: int = 3, hysteresis: int = 1, minimum: float = 1.0, dynamic=True
) -> LossScaler:
    cfg = PrecisionConfig(
        loss_scale=scale,
        loss_scale_growth_interval=growth,
        loss_scale_hysteresis=hysteresis,
        loss_scale_min=minimum,
    )
    return LossScaler(cfg, dynamic=dynamic)


def updates(s: LossScaler, overflows: str) -> list[tuple[float, str]]:
    """(scale, change) after each step of `overflows`: `.` a clean step, `x` an overflow."""
    return [(u.scale, u.changed) for u in (s.update(c == "x") for c in overflows)]


def test_the_scale_doubles_after_each_growth_interval_of_clean_steps():
    assert updates(scaler(growth=3), "......") == [
        (8.0, ""),
        (8.0, ""),
        (16.0, "growth"),
        (16.0, ""),
        (16.0, ""),
        (32.0, "growth"),
    ]


def test_an_overflow_halves_the_scale_and_restarts_the_clean_count():
    s = scaler(growth=3)
    assert s.update(False) == ScaleUpdate(8.0, False)
    assert s.update(False) == ScaleUpdate(8.0, False)
    assert s.update(True) == ScaleUpdate(4.0, True, changed="backoff")
    # Growth needs three clean steps after the overflow, not one more.
    assert updates(s, "...") == [(4.0, ""), (4.0, ""), (8.0, "growth")]


def test_hysteresis_halves_at_every_nth_overflow_and_growth_resets_it():
    s = scaler(scale=64.0, growth=4, hysteresis=3)
    assert updates(s, "xx.x") == [(64.0, ""), (64.0, ""), (64.0, ""), (32.0, "backoff")]
    assert s.overflows_left == 3  # a back-off starts the count again
    assert updates(s, "xx") == [(32.0, ""), (32.0, "")]
    assert updates(s, "....") == [(32.0, ""), (32.0, ""), (32.0, ""), (64.0, "growth")]
    assert updates(s, "xx") == [(64.0, ""), (64.0, "")]  # growth forgave the two before it
    assert s.update(True) == ScaleUpdate(32.0, True, changed="backoff")


def test_every_overflow_reports_itself_even_when_the_scale_holds():
    s = scaler(hysteresis=2)
    assert s.update(True) == ScaleUpdate(8.0, True)  # the step is skipped all the same


def test_the_scale_stops_at_the_minimum_and_an_overflow_there_is_flagged():
    s = scaler(scale=6.0, minimum=4.0)
    assert s.update(True) == ScaleUpdate(4.0, True, changed="backoff")  # not 3: clamped
    assert s.update(True) == ScaleUpdate(4.0, True, at_min=True)
    assert s.update(True) == ScaleUpdate(4.0, True, at_min=True)
    assert s.scale == 4.0


def test_an_overflow_at_the_minimum_uses_up_no_hysteresis():
    s = scaler(scale=2.0, minimum=2.0, hysteresis=2)
    assert s.update(True).at_min and s.overflows_left == 2


def test_a_static_scale_never_changes_and_every_overflow_is_flagged():
    s = scaler(scale=128.0, growth=2, dynamic=False)
    assert [s.update(False) for _ in range(5)] == [ScaleUpdate(128.0, False)] * 5
    assert s.update(True) == ScaleUpdate(128.0, True, at_min=True)
    assert s.scale == 128.0


def test_the_state_dict_resumes_the_same_sequence():
    s = scaler(scale=64.0, growth=4, hysteresis=3)
    updates(s, "..x.x.")  # mid-way through both the growth interval and the hysteresis
    state = s.state_dict()
    assert state == {"scale": 64.0, "clean_steps": 1, "overflows_left": 1}
    restored = scaler(scale=1024.0, growth=4, hysteresis=3)
    restored.load_state_dict(state)
    assert updates(restored, "x...x...") == updates(s, "x...x...")
    assert restored.state_dict() == s.state_dict()
