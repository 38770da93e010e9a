"""Replica groups in the report: quorum size over time and each failure's costs, from events."""

import pytest

from bigtrain.telemetry.ft_report import failures, failures_html, quorum_series

pytestmark = pytest.mark.unit


def event(time, step, kind, group, **details):
    return {"time": time, "step": step, "kind": kind, "group": group, **details}


EVENTS = [
    *(
        event(1.0 + g / 10, 1, "quorum", g, participants=[0, 1, 2], groups=3, quorum_id=1)
        for g in range(3)
    ),
    event(5.0, 9, "fault", 1, type="kill_group"),
    event(5.1, 9, "commit_failed", 0, reason="closed by peer"),
    event(6.5, 9, "quorum", 0, participants=[0, 2], groups=2, quorum_id=2),
    event(6.6, 9, "quorum", 2, participants=[0, 2], groups=2, quorum_id=2),
    event(14.0, 30, "quorum", 1, participants=[0, 1, 2], groups=3, quorum_id=3),
    event(14.0, 30, "group_joined", 1, seconds=7.5, transfer_s=0.2, bytes=1000),
    event(14.1, 30, "quorum", 0, participants=[0, 1, 2], groups=3, quorum_id=3),
]


def test_the_quorum_series_counts_each_membership_change_once():
    assert quorum_series(EVENTS) == ([1, 9, 30], [3, 2, 3])


def test_a_failure_is_a_quorum_that_lost_a_group_with_what_it_cost():
    (row,) = failures(EVENTS)
    assert row == {
        "step": 9,
        "group": 1,
        "survivors_stall_s": 1.5,  # the group's last event (its kill) to the quorum without it
        "away_s": 9.0,  # to its join
        "joined_step": 30,
        "join_s": 7.5,
        "transfer_s": 0.2,
        "bytes": 1000,
    }
    assert "<td>9.0</td>" in failures_html([row])


def test_a_run_without_replica_groups_has_no_quorum_and_no_failures():
    plain = [{"time": 1.0, "step": 1, "kind": "start"}]
    assert quorum_series(plain) == ([], []) and failures(plain) == [] and failures_html([]) == ""
