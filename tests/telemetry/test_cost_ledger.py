"""The cost ledger's bookkeeping on events alone (callbacks/cost_ledger.py), and the restart gap's read
of the last event (utils/clock.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from bigtrain.callbacks.cost_ledger import CostLedger
from bigtrain.utils.clock import StartupClock, last_event_time

pytestmark = pytest.mark.unit


def event(kind: str, time: float, **details) -> dict:
    return {"kind": kind, "time": time, "step": 0, **details}


def rollback(time: float, from_step: int, to_step: int) -> dict:
    return event("rollback", time, from_step=from_step, to_step=to_step, source="memory")


def test_two_rollbacks_before_a_step_resumes_are_both_kept_and_a_skipped_anomaly_dates_none():
    ledger = CostLedger(StartupClock())
    trainer = SimpleNamespace()
    ledger.on_event(trainer, event("anomaly", 100.0))
    ledger.on_event(trainer, rollback(101.0, 30, 20))
    ledger.on_event(trainer, event("anomaly", 102.0))
    ledger.on_event(trainer, rollback(104.0, 21, 10))  # again, before any step resumed
    assert [r["steps_lost"] for r in ledger.rollbacks] == [10]
    assert ledger.rollbacks[0]["restore_s"] == 1.0 and ledger.rollbacks[0]["seconds"] == 4.0
    assert ledger.pending["restore_s"] == 2.0 and ledger.pending["steps_lost"] == 11
    # An anomaly that was only skipped leaves no time behind for a rollback without its own.
    ledger.on_event(trainer, rollback(200.0, 40, 35))
    assert ledger.pending["from_step"] == 21  # not replaced: no anomaly dates this one


def test_checkpoint_costs_count_each_stall_once_and_bytes_per_rank():
    ledger = CostLedger(StartupClock())
    trainer = SimpleNamespace()
    ledger.on_event(trainer, event("checkpoint_started", 1.0, stall_s=0.5))
    common = {"path": "p", "write_s": 2.0, "bytes_per_rank": [100, 300], "seconds": 2.5}
    ledger.on_event(trainer, event("checkpoint", 3.0, stall_s=0.5, **{"async": True}, **common))
    ledger.on_event(trainer, event("checkpoint", 9.0, stall_s=2.5, **{"async": False}, **common))
    assert ledger.stalls.to_dict()["seconds"] == 3.0 and ledger.stalls.count == 2
    assert ledger.writes.count == 2 and ledger.writes.to_dict()["bytes_each"] == 300


def test_the_last_event_time_is_found_behind_a_line_longer_than_the_window(tmp_path):
    events = tmp_path / "events.jsonl"
    lines = [
        {"kind": "start", "time": 1.5},
        {"kind": "checkpoint", "time": 7.25, "bytes_per_rank": list(range(30_000))},
    ]
    events.write_text("".join(json.dumps(e) + "\n" for e in lines))
    assert events.stat().st_size > 4 * 4096
    assert last_event_time(events, chunk=4096) == 7.25
    events.write_text(json.dumps(lines[0]) + "\n" + '{"kind": "cut')  # a torn last line
    assert last_event_time(events, chunk=8) == 1.5
    assert last_event_time(tmp_path / "none.jsonl") is None
