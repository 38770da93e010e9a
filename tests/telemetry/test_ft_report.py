"""Replica groups in the report: quorum size over time and each failure's costs, from events."""

import pytest

from bigtrain.telemetry.ft_report import failures, failures_html, quorum_series

pytestmark = pytest.mark.unit


def event(time, step, kind, group, **details):
    return {"time": time, "step": step, "kind": kind, "group": group, **details}


def quorum(time, step, group, participants, quorum_id, last_commit=None):
    return event(
        time,
        step,
        "quorum",
        group,
        participants=participants,
        groups=len(participants),
        quorum_id=quorum_id,
        last_commit_time=last_commit,
        median_step_s=0.5 if last_commit is not None else None,
    )


# Group 1 is killed inside step 9 (its last event long before: groups write no event a step);
# the survivors last committed step 8 at t=20.0, form a quorum without it, and commit step 9
# at 22.3; group 1's new process joins at step 30 and commits at 31.5.
EVENTS = [
    *(quorum(1.0 + g / 10, 1, g, [0, 1, 2], 1) for g in range(3)),
    *(event(2.0 + g / 10, 1, "quorum_commit", g, quorum_id=1) for g in range(3)),
    event(20.1, 9, "fault", 1, type="kill_group"),
    event(20.2, 9, "commit_failed", 0, reason="closed by peer"),
    quorum(21.5, 9, 0, [0, 2], 2, last_commit=20.0),
    quorum(21.6, 9, 2, [0, 2], 2, last_commit=20.0),
    event(21.5, 9, "group_left", 1, reason="dead", waited_s=1.1, reported_by=0),
    event(22.3, 9, "quorum_commit", 0, quorum_id=2),
    event(22.4, 9, "quorum_commit", 2, quorum_id=2),
    quorum(31.0, 30, 1, [0, 1, 2], 3),
    event(31.0, 30, "group_joined", 1, seconds=7.5, transfer_s=0.2, bytes=1000),
    quorum(31.1, 30, 0, [0, 1, 2], 3, last_commit=30.9),
    event(31.5, 30, "quorum_commit", 1, quorum_id=3),
    event(31.6, 30, "quorum_commit", 0, quorum_id=3),
]


def test_the_quorum_series_counts_each_membership_change_once():
    assert quorum_series(EVENTS) == ([1, 9, 30], [3, 2, 3])


def test_a_failure_is_a_quorum_that_lost_a_group_with_what_it_cost():
    (row,) = failures(EVENTS)
    assert row == {
        "step": 9,
        "group": 1,
        "reason": "dead",
        "commit_gap_s": 2.3,  # last commit before (20.0) to the survivors' first after (22.3)
        "survivors_stall_s": 1.8,  # less one median step (0.5 s)
        "away_s": 11.5,  # to the rejoined group's first commit (31.5)
        "joined_step": 30,
        "join_s": 7.5,
        "transfer_s": 0.2,
        "bytes": 1000,
    }
    assert "<td>1.8</td>" in failures_html([row])


def test_a_late_group_that_caught_up_has_no_join_time():
    """A live group left out for being late took a peer's state in the same process: its
    `group_joined` has no `seconds`, and the row no join_s (its process age is no cost)."""
    late = [
        *(quorum(1.0, 1, g, [0, 1], 1) for g in range(2)),
        quorum(80.0, 5, 0, [0], 2, last_commit=19.0),
        event(80.0, 5, "group_left", 1, reason="late", waited_s=60.2, reported_by=0),
        event(80.5, 5, "quorum_commit", 0, quorum_id=2),
        quorum(81.0, 6, 1, [0, 1], 3),
        event(81.0, 6, "group_joined", 1, transfer_s=0.1, bytes=10),
        event(81.4, 6, "quorum_commit", 1, quorum_id=3),
    ]
    (row,) = failures(late)
    assert row["reason"] == "late" and "join_s" not in row
    assert row["away_s"] == 62.4 and row["survivors_stall_s"] == 61.0


def test_a_run_without_replica_groups_has_no_quorum_and_no_failures():
    plain = [{"time": 1.0, "step": 1, "kind": "start"}]
    assert quorum_series(plain) == ([], []) and failures(plain) == [] and failures_html([]) == ""
