"""The straggler rule: a rank against the median of the other ranks, on 2, 3 and 64 ranks; the
floor below which a part's excess is noise; the timing steps in a row before a rank is named; the
report's events (a stub trainer, the gather faked). A real 2-rank run: tests/callbacks/test_heal.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from bigtrain.callbacks import straggler
from bigtrain.callbacks.straggler import (
    CONSECUTIVE,
    MIN_SHARE,
    StragglerReport,
    Streaks,
    find_stragglers,
)
from bigtrain.parallel.replicas.groups import NoReplicaGroups
from bigtrain.train.step import StepResult
from bigtrain.train.timing import StepTimer

pytestmark = pytest.mark.unit

FACTOR = 1.3  # monitor.straggler_factor's default


def rank(forward_backward: float = 0.3, **parts: float) -> dict[str, float]:
    """One rank's parts of a step (seconds) whose forward+backward takes most of it."""
    return {
        "data": 0.002,
        "forward_backward": forward_backward,
        "sync": 0.0,
        "optimizer": 0.02,
        "other": 0.001,
        **parts,
    }


def named(by_rank: list[dict[str, float]], factor: float = FACTOR) -> list[tuple[int, str]]:
    return [(s["member"], s["part"]) for s in find_stragglers(by_rank, factor)]


def test_a_rank_1_5x_slower_than_its_peer_is_named_on_2_ranks():
    # The run: 0.517 s against 0.323 s (1.6x). The median of both ranks (0.420 s) held
    # the slow one, and 1.3x of it was never reached; 1.3x of the other rank is.
    assert named([rank(0.323), rank(0.517)]) == [(1, "forward_backward")]
    assert named([rank(0.3), rank(0.45)]) == [(1, "forward_backward")]  # 1.5x
    found = find_stragglers([rank(0.3), rank(0.45)], FACTOR)[0]
    assert found["seconds"] == 0.45 and found["others_median_s"] == 0.3
    assert named([rank(0.3), rank(0.36)]) == []  # 1.2x: within the factor


def test_a_rank_1_5x_slower_than_its_peers_is_named_on_3_ranks():
    assert named([rank(0.3), rank(0.45), rank(0.31)]) == [(1, "forward_backward")]
    assert named([rank(0.3), rank(0.33), rank(0.28)]) == []  # a healthy spread of 18%


def test_64_ranks_name_the_slow_ones_while_they_are_at_most_half():
    healthy = [rank(0.27 + 0.06 * i / 63) for i in range(64)]  # 0.27-0.33 s: 22% spread
    assert named(healthy) == []
    one_slow = [*healthy[:40], rank(0.45), *healthy[41:]]
    assert named(one_slow) == [(40, "forward_backward")]
    # 32 slow: each is judged against 32 healthy and 31 slow peers, a healthy median.
    half = [rank(0.45) if i % 2 else r for i, r in enumerate(healthy)]
    assert named(half) == [(r, "forward_backward") for r in range(1, 64, 2)]
    # 33 slow: slow is what a rank typically does; nobody stands out against its peers.
    most = [rank(0.45), *half[1:]]
    assert named(most) == []


def test_a_part_must_cost_a_share_of_the_step_and_waiting_is_never_judged():
    # An optimizer step stalled 4x by the scheduler: 60 ms more, 17% of a 0.35 s step.
    assert MIN_SHARE == 0.2
    assert named([rank(optimizer=0.02), rank(optimizer=0.08)]) == []
    # 100 ms more is 27% of the step: that rank holds every other one back.
    assert named([rank(optimizer=0.02), rank(optimizer=0.12)]) == [(1, "optimizer")]
    # The fast rank waits in sync for the slow one: the symptom, not a straggler.
    assert named([rank(0.3, sync=0.2), rank(0.5)]) == [(1, "forward_backward")]
    # Short steps: the 10 ms floor (MIN_EXCESS_S) holds where 10% of the step is less.
    assert named([rank(0.02, optimizer=0.001), rank(0.028, optimizer=0.001)]) == []


def test_a_lone_member_has_no_peers():
    assert find_stragglers([rank(5.0)], FACTOR) == []
    assert find_stragglers([], FACTOR) == []


def test_a_rank_is_named_after_consecutive_timing_steps_and_a_gap_starts_again():
    streaks = Streaks(2)
    slow = (1, "forward_backward")
    assert streaks.update([slow]) == set()
    assert streaks.update([slow]) == {slow}
    assert streaks.update([slow, (0, "data")]) == {slow}  # named on every step it stays slow
    assert streaks.update([(0, "data")]) == {(0, "data")}
    assert streaks.update([slow]) == set()  # its streak ended at the step it was not found
    assert Streaks(1).update([slow]) == {slow}


def report_events(times_by_step: list[list[dict[str, float]]], monkeypatch) -> list[dict]:
    """StragglerReport over timing steps whose all-gather returns `times_by_step[i]`."""
    events = []
    trainer = SimpleNamespace(
        device=torch.device("cpu"),
        event=lambda kind, **details: events.append({"kind": kind, **details}),
        replicas=NoReplicaGroups(),
        timer=StepTimer(torch.device("cpu"), 1),
    )
    report = StragglerReport(FACTOR)
    for step, by_rank in enumerate(times_by_step, start=1):
        gathered = [{**times, straggler.PEAK: 1000 + r} for r, times in enumerate(by_rank)]
        monkeypatch.setattr(straggler, "all_gather_objects", lambda _mine, g=gathered: g)
        result = StepResult(step=step, lr=1e-3, step_timing=by_rank[0])
        report.on_step_end(trainer, result)
        assert result.step_time_by_rank["forward_backward"] == [
            t["forward_backward"] for t in by_rank
        ]
        assert result.peak_memory_bytes_by_rank == [1000 + r for r in range(len(by_rank))]
        for event in events:
            event.setdefault("step", step)
    return events


def test_the_report_names_a_slow_rank_from_its_second_timing_step_on(monkeypatch):
    assert CONSECUTIVE == 2  # the steps below assume it
    slow = [rank(0.3), rank(0.5)]
    events = report_events([slow, [rank(0.3), rank(0.31)], slow, slow, slow], monkeypatch)
    assert [e["step"] for e in events] == [4, 5]  # the healthy step 2 ended the first streak
    assert events[0] == {
        "kind": "straggler",
        "rank": 1,
        "part": "forward_backward",
        "seconds": 0.5,
        "others_median_s": 0.3,
        "ratio": 1.67,
        "timing_steps": 2,
        "step": 4,
    }
    assert events[1]["timing_steps"] == 3


class Groups:
    """Replica groups as the report sees them: each group's work seconds of this step's
    reduction, and whether this group leads (writes the events)."""

    def __init__(self, leads: bool = True) -> None:
        self.times: dict[int, float] = {}
        self.leads = leads

    def group_times(self) -> dict[int, float]:
        return self.times


def test_a_slow_replica_group_is_named_against_the_other_groups(monkeypatch):
    """Group 2's own work takes 1.5x the others' on two timing steps in a row: named at the
    second (`result.slow_groups`, and a `straggler` event with scope `group` from the leading
    group only); its ranks are not compared with other groups' ranks."""
    events = []
    groups = Groups()
    trainer = SimpleNamespace(
        device=torch.device("cpu"),
        event=lambda kind, **details: events.append({"kind": kind, **details}),
        replicas=groups,
        timer=StepTimer(torch.device("cpu"), 1),
    )
    report = StragglerReport(FACTOR)
    monkeypatch.setattr(straggler, "all_gather_objects", lambda mine: [mine])
    slow_groups = []
    for step, times in enumerate([{0: 0.3, 1: 0.31, 2: 0.45}] * 3, start=1):
        groups.times = times
        result = StepResult(step=step, lr=1e-3, step_timing=rank(0.3))
        report.on_step_end(trainer, result)
        slow_groups.append(result.slow_groups)
    assert slow_groups == [{}, {2: 2}, {2: 3}]
    assert [(e["group"], e["scope"], e["timing_steps"]) for e in events] == [
        (2, "group", 2),
        (2, "group", 3),
    ]
    assert events[0]["others_median_s"] == pytest.approx(0.305)
    assert events[0]["ratio"] == pytest.approx(1.48)
    # a rejoining group's report starts from the same streaks (they travel with the state)
    rejoined = StragglerReport(FACTOR)
    rejoined.load_state_dict(report.state_dict())
    groups.leads, groups.times = False, {0: 0.3, 1: 0.31, 2: 0.45}
    result = StepResult(step=4, lr=1e-3, step_timing=rank(0.3))
    rejoined.on_step_end(trainer, result)
    assert result.slow_groups == {2: 4} and len(events) == 2  # not the leader: no event


def test_the_console_says_why_a_group_left():
    from bigtrain.telemetry.console import event_line

    dead = {
        "kind": "group_left",
        "step": 12,
        "group": 1,
        "reason": "dead",
        "waited_s": 1.04,
        "reported_by": 0,
    }
    assert event_line(dead) == (
        "replica group 1 left out of step 12's quorum: its heartbeats stopped (the quorum came "
        "after 1.0 s)"
    )
    late = {**dead, "reason": "late", "reported_by": 1, "missed_steps": 2}
    assert "was late for step 12's quorum: the others trained 2 step(s)" in event_line(late)
    slow = {"kind": "group_left", "step": 40, "group": 2, "reason": "slow", "timing_steps": 5}
    assert "leaves the job at step 40: the straggler on 5 timing steps" in event_line(slow)
    group = {
        "kind": "straggler",
        "step": 6,
        "group": 2,
        "scope": "group",
        "part": "work",
        "seconds": 0.45,
        "ratio": 1.48,
    }
    assert "replica group 2's work (data and forward+backward) took 0.45 s" in event_line(group)


def test_a_rank_found_once_has_the_next_step_timed_to_confirm_it(monkeypatch):
    """With timing every 50 steps, a slow rank found at step 50 is confirmed at step 51 (the
    60-step run of the issue was never named: its only timing step was 50)."""
    timer = StepTimer(torch.device("cpu"), 50)
    trainer = SimpleNamespace(
        device=torch.device("cpu"),
        event=lambda kind, **details: events.append({"kind": kind, "step": step, **details}),
        replicas=NoReplicaGroups(),
        timer=timer,
    )
    events, report = [], StragglerReport(FACTOR)
    ranks = [{**rank(0.3), straggler.PEAK: 0}, {**rank(0.5), straggler.PEAK: 0}]
    monkeypatch.setattr(straggler, "all_gather_objects", lambda mine: ranks)
    timed = []
    for step in range(48, 54):
        timer.start(step)
        result = StepResult(step=step, lr=1e-3, step_timing=timer.finish())
        timed.append(result.step_timing is not None)
        report.on_step_end(trainer, result)
    assert timed == [False, False, True, True, False, False]  # 50, and 51 to confirm
    assert [(e["step"], e["rank"]) for e in events] == [(51, 1)]
