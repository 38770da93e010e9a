"""Costs measured by a run feed the goodput plan end to end: a 2-rank FSDP2 run with a NaN at step
12 (rolled back from memory) and checkpoints, stopped at step 20 and resumed to 24 (a restart
with a checkpoint load), then `bigtrain report` (the time-lost table) and `plan --goodput --from`."""

from __future__ import annotations

import json

import pytest

from bigtrain.cli import main
from tests.distributed import mesh_run_args, run_distributed, train_run

pytestmark = pytest.mark.distributed

RUN = (
    "parallel.backend=fsdp",
    "train.max_steps=24",
    "checkpoint.every=10",
    "resilience.snapshot_every=5",
    "resilience.confirm_steps=3",
    "drill.nan_grad_step=12",
)


def kinds(events: list[dict], kind: str) -> list[dict]:
    return [e for e in events if e["kind"] == kind]


def test_a_short_run_measures_its_costs_and_feeds_the_goodput_plan(
    tmp_path, corpus_files, cache_dir, capsys
):
    args = mesh_run_args(tmp_path, "run", corpus_files, cache_dir, *RUN)
    run_distributed(train_run, 2, [*args, "train.stop_at_step=20"])
    result = run_distributed(train_run, 2, args)[0]
    events, out = result["events"], tmp_path / "run"

    first, resumed = kinds(events, "startup")
    RECORD = set(resumed) - {"time", "step", "kind"}  # noqa: N806
    phases = ("process", "process_group", "data", "model", "checkpoint_load", "setup_other")
    assert all(first[f"{p}_s"] >= 0 for p in phases) and first["total_s"] > first["first_step_s"]
    assert first["total_s"] == pytest.approx(
        sum(first[f"{p}_s"] for p in phases) + first["first_step_s"], abs=0.01
    )
    assert "restart_gap_s" not in first and resumed["restart_gap_s"] >= 0
    assert resumed["checkpoint_load_s"] > 0
    saves = kinds(events, "checkpoint")
    assert all(len(c["bytes_per_rank"]) == 2 and min(c["bytes_per_rank"]) > 0 for c in saves)
    assert all(c["write_s"] > 0 and c["stall_s"] > 0 for c in saves)
    (recovered,) = kinds(events, "recovered")
    assert (recovered["from_step"], recovered["to_step"], recovered["source"]) == (12, 5, "memory")
    assert recovered["steps_lost"] == 7 and 0 < recovered["restore_s"] < recovered["seconds"]
    assert kinds(events, "replay")[0]["seconds"] > 0
    stopped, ended = kinds(events, "costs")
    same = {k: v for k, v in recovered.items() if k not in ("time", "step", "kind")}
    assert stopped["rollbacks"] == [same] and stopped["snapshots"]["count"] >= 3
    assert stopped["snapshots"]["bytes_each"] > 0 and ended["steps"] == 4
    final = json.loads((out / "final.json").read_text())
    assert final["costs"]["startup"] == {k: v for k, v in resumed.items() if k in RECORD}

    assert main(["report", str(out)]) == 0
    lost = json.loads((out / "report" / "time_lost.json").read_text())
    assert lost["wall"] == pytest.approx(sum(v for k, v in lost.items() if k != "wall"))
    assert lost["productive"] > 0 and lost["rollback_redone"] > 0 and lost["startup"] > 0
    assert "time lost" in (out / "report" / "index.html").read_text()

    capsys.readouterr()
    argv = ["plan", "--goodput", "--gpus", "2", "--from", str(out), "--json", "--trials", "20"]
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    measured = {k for k, how in plan["sources"].items() if how.startswith("measured")}
    # The micro model's checkpoints are small: their time is fixed cost, not bandwidth.
    assert {"write_fixed_s", "stall_fixed_s", "replay_steps", "restart_s"} <= measured
    assert not {"save_gbps_per_node", "snapshot_gbps", "load_gbps_per_node"} & measured
    assert 0 < plan["goodput"] <= 1 and plan["goodput_band"][0] <= plan["goodput_band"][1]
    assert set(plan["lost_by_cause"]) >= {"restart", "lost_work", "checkpoint_stall"}
    # At a larger scale than the run, its measured fixed costs are shown but not used.
    argv[3] = "64"
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "not used" in plan["sources"]["restart_s"] and plan["inputs"]["restart_s"] == 600
    for key in ("write_fixed_s", "stall_fixed_s"):
        assert "not used" in plan["sources"][key] and plan["inputs"][key] == 0, key
