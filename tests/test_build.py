"""The run's assembly (bigtrain/build.py): the callbacks of a run in their one stated order."""

from __future__ import annotations

import pytest

from bigtrain.build import BuiltParts, make_callbacks
from bigtrain.callbacks.cost_ledger import CostLedger
from bigtrain.checkpoint.manager import CheckpointManager
from bigtrain.config import load_config
from bigtrain.parallel.env import DistEnv
from bigtrain.store.rundir import RunDir
from bigtrain.utils.clock import StartupClock

pytestmark = pytest.mark.unit


def callback_names(tmp_path, *overrides: str, sinks: list | None = None) -> list[str]:
    cfg = load_config([], list(overrides))
    manager = CheckpointManager(tmp_path / "checkpoints", keep=1)
    parts = BuiltParts([], {}, {}, str(tmp_path), sinks or [], CostLedger(StartupClock()))
    made = make_callbacks(cfg, DistEnv(), RunDir(tmp_path, True), manager, parts)
    return [type(c).__name__ for c in made]


def test_the_callbacks_run_in_the_order_the_assembly_states(tmp_path):
    """Who writes a step field runs before who reads it: evaluation (val_loss), the straggler
    report (step_time_by_rank) and the metrics logger (record) before the console and the sinks;
    preemption, the watchdog and the profiler last."""
    assert callback_names(tmp_path) == [
        "Drills",
        "EvalCallback",
        "CheckpointCallback",
        "StragglerReport",
        "MetricsLogger",
        "CostLedger",
        "ConsoleProgress",
        "PreemptionHandler",
        "HangWatchdog",
    ]
    optional = callback_names(tmp_path, "profile.steps=[2,3]", sinks=[object()])
    assert optional == [
        "Drills",
        "EvalCallback",
        "CheckpointCallback",
        "StragglerReport",
        "MetricsLogger",
        "CostLedger",
        "ConsoleProgress",
        "SinkLogger",
        "PreemptionHandler",
        "HangWatchdog",
        "ProfilerCallback",
    ]
