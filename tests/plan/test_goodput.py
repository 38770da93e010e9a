"""The goodput simulation against Young's and Daly's closed forms, the Llama 3 report, itself (seeds,
accounting), fault-tolerant replica groups against plain restarts, and `plan --goodput`'s bad
input."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from bigtrain.cli import main
from bigtrain.config import load_config
from bigtrain.plan.goodput import plan_goodput, run_mode
from bigtrain.plan.goodput_inputs import LLAMA3_COUNTS, GoodputInputs
from bigtrain.plan.simulation import (
    CAUSES,
    SimParams,
    best_interval,
    daly_goodput,
    daly_interval,
    failure_stream,
    simulate,
    young_interval,
)

pytestmark = pytest.mark.unit


def plain(mtbf_s: float, cost_s: float, restart_s: float, days: float = 54) -> SimParams:
    """Young's and Daly's assumptions: exponential failures, fixed blocking checkpoint cost and
    restart, nothing else."""
    return SimParams(
        horizon_s=days * 86400,
        rates={"hardware": 1 / mtbf_s},
        step_s=1.0,
        stall_s=cost_s,
        write_s=cost_s,
        async_save=False,
        restart_s=restart_s,
        hang_timeout_s=0,
        plain_hang_timeout_s=0,
        snapshot_overhead=0,
        snapshot_work_s=0,
        confirm_work_s=0,
        restore_s=0,
        replay_s=0,
        save_s=cost_s,
    )


@pytest.mark.parametrize(
    ("mtbf_s", "cost_s", "restart_s"),
    [(4 * 3600, 60, 300), (3600, 120, 600), (12 * 3600, 20, 60)],
)
def test_the_simulation_reproduces_daly_where_his_assumptions_hold(mtbf_s, cost_s, restart_s):
    daly = daly_interval(cost_s, mtbf_s)
    grid = daly * np.geomspace(1 / 4, 4, 33)
    p = plain(mtbf_s, cost_s, restart_s, days=600 * mtbf_s / 86400)  # 600 failures a run
    best = best_interval(grid, simulate(p, grid, False, 200, seed=1).mean())
    assert best == pytest.approx(daly, rel=0.02)  # seen: within 0.7%
    at = simulate(p, [daly], False, 200, seed=2)
    expected = daly_goodput(daly, cost_s, restart_s, mtbf_s)
    assert at.mean()[0] == pytest.approx(expected, rel=0.005)  # seen: within 0.04%
    # Young's first-order interval is the same to within its own error (sqrt(C / 2M) terms).
    assert young_interval(cost_s, mtbf_s) == pytest.approx(daly, rel=0.1)


def test_daly_closed_forms():
    # Daly 2006: sqrt(2 C M) [1 + 1/3 sqrt(C/2M) + 1/9 (C/2M)] - C, and M when C >= 2M.
    c, m = 300.0, 6 * 3600.0
    r = c / (2 * m)
    assert daly_interval(c, m) == pytest.approx(
        np.sqrt(2 * c * m) * (1 + np.sqrt(r) / 3 + r / 9) - c
    )
    assert daly_interval(3 * m, m) == m
    # Its optimum maximises its own complete model's goodput.
    grid = np.linspace(0.5, 1.5, 2001) * daly_interval(c, m)
    values = [daly_goodput(t, c, 600, m) for t in grid]
    assert grid[int(np.argmax(values))] == pytest.approx(daly_interval(c, m), rel=0.01)


def test_the_simulation_is_deterministic_for_a_seed_and_accounts_for_every_second():
    inputs = GoodputInputs(gpus=4096, step_s=3.0, ckpt_gb_per_gpu=0.5)
    inputs = dataclasses.replace(inputs, rates={**inputs.rates, "transient": 2e-6})
    p = inputs.sim_params()
    grid = np.array([300.0, 900.0, 2700.0])
    first = simulate(p, grid, True, 20, seed=7)
    again = simulate(p, grid, True, 20, seed=7)
    other = simulate(p, grid, True, 20, seed=8)
    assert np.array_equal(first.goodput, again.goodput)
    assert np.array_equal(first.lost, again.lost)
    assert not np.array_equal(first.goodput, other.goodput)
    total = first.goodput * p.horizon_s + first.lost.sum(axis=0)
    assert np.allclose(total, p.horizon_s, rtol=1e-9)
    assert (first.lost >= -1e-6).all()
    assert set(first.lost_fractions(0)) == set(CAUSES)


def test_suspicion_replays_cost_their_share_of_the_work():
    """10 replayed steps per 1,000: about 1% of the work's time, under `suspicions`."""
    inputs = GoodputInputs(gpus=4096, step_s=3.0, ckpt_gb_per_gpu=0.5)
    grid = np.array([900.0])
    off = simulate(dataclasses.replace(inputs, suspicions_per_1k=0).sim_params(), grid, True, 20, 7)
    on = simulate(dataclasses.replace(inputs, suspicions_per_1k=10).sim_params(), grid, True, 20, 7)
    assert off.lost_fractions(0)["suspicions"] == 0.0
    share = on.lost_fractions(0)["suspicions"]
    assert share == pytest.approx(0.01 * on.goodput.mean(), rel=0.05)
    assert on.goodput.mean() < off.goodput.mean()


def llama3_405b() -> GoodputInputs:
    """Llama 3 405B as its report describes it: 16,384 H100s, 54 days, 16M-token batches at
    38-43% MFU, FP32 master weights and Adam moments (12 B/param), sharded."""
    step_s = 6 * 405e9 * 16e6 / (16_384 * 989e12 * 0.4)
    return GoodputInputs(gpus=16_384, step_s=step_s, ckpt_gb_per_gpu=405e9 * 12 / 16_384 / 1e9)


def test_llama3_inputs_land_in_the_reports_range():
    inputs = llama3_405b()
    p = inputs.sim_params()
    times, _ = failure_stream(p.rates, p.horizon_s, 100, seed=0)
    interruptions = np.isfinite(times).sum(axis=1).mean()
    assert interruptions == pytest.approx(sum(LLAMA3_COUNTS.values()), rel=0.03)  # 466
    result = run_mode(inputs, healing=False, trials=50, seed=0)
    # "more than 90% effective training time", from restarts of about 10 minutes
    assert 0.90 < result.goodput_at_best < 0.97
    assert result.lost["restart"] > result.lost["checkpoint_stall"]


def test_healing_beats_plain_restarts_when_numeric_faults_are_common():
    inputs = GoodputInputs(gpus=2048, step_s=5.0, ckpt_gb_per_gpu=0.4)
    rates = {**inputs.rates, "numeric": 2e-5, "transient": 2e-5}
    inputs = dataclasses.replace(inputs, rates=rates)
    healing = run_mode(inputs, healing=True, trials=30, seed=0)
    plain_cr = run_mode(inputs, healing=False, trials=30, seed=0)
    assert healing.goodput > plain_cr.goodput + 0.01
    assert healing.lost["rollback"] > 0 and healing.lost["replay"] > 0
    assert plain_cr.lost["rollback"] == plain_cr.lost["replay"] == 0


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--set", "rate.cosmic=1e-6"], "unknown failure kind 'cosmic'"),
        (["--set", "rate.hardware=-1e-6"], "'rate.hardware' got -1e-06"),
        (["--set", "restart_s=-5"], "'restart_s' got -5"),
        (["--set", "restrat_s=5"], "did you mean 'restart_s'"),
        (["--set", "restart_s"], "expected key=value"),
        (["parallel.tensor_parallel=8", "--gpus", "100"], "--gpus 100 is not a multiple"),
        (["--gpus", "0"], "--gpus got 0"),
        (["--set", "replica_groups=0"], "'replica_groups' got 0"),
        (["--set", "replica_groups=3"], "replica_groups (3) must divide --gpus (64)"),
    ],
)
def test_bad_input_exits_2_naming_the_key(capsys, args, named):
    argv = ["plan", "configs/llama-7b.yaml", "--goodput", *args]
    if "--gpus" not in args:
        argv += ["--gpus", "64"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert named in err and len(err.splitlines()) == 1


def test_a_run_directory_without_cost_events_exits_2_naming_the_file(capsys, tmp_path):
    (tmp_path / "config.yaml").write_text("train:\n  max_steps: 10\n")
    argv = ["plan", "--goodput", "--gpus", "8", "--from", str(tmp_path)]
    assert main(argv) == 2
    assert str(tmp_path / "events.jsonl") in capsys.readouterr().err
    (tmp_path / "events.jsonl").write_text(json.dumps({"time": 1, "step": 0, "kind": "start"}))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "events.jsonl") in err and "'startup'" in err


def micro_run_dir(path: Path) -> Path:
    """The events a one-process micro run writes: its costs are those of 1 rank on a CPU."""
    path.mkdir()
    (path / "config.yaml").write_text(
        "model:\n  n_layers: 2\n  d_model: 64\n  n_heads: 2\n  seq_len: 32\n"
        "data:\n  vocab_size: 384\ncheckpoint:\n  every: 25\n"
    )
    events = [
        {"time": 1, "step": 0, "kind": "start", "world_size": 1, "device": "cpu"},
        {"time": 2, "step": 1, "kind": "startup", "total_s": 5.0, "checkpoint_load_s": 0.0},
        {"time": 3, "step": 25, "kind": "checkpoint", "path": str(path / "step_00000025")}
        | {"bytes_per_rank": [2_000_000], "write_s": 0.12, "stall_s": 0.005, "async": True},
        {"time": 4, "step": 50, "kind": "costs", "median_step_s": 0.14, "rollbacks": []}
        | {"snapshots": {"count": 0, "mean_s": 0.0}, "replays": {"count": 0, "mean_s": 0.0}},
    ]
    (path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return path


def test_a_plan_from_a_micro_run_says_what_it_did_not_use(capsys, tmp_path):
    """A 1-rank CPU run's fixed costs and step time say nothing of 512 GPUs: the plan names
    each one it left out, counts the model's parameters as they are (no '0.00B'), and its table
    columns line up."""
    run_dir = micro_run_dir(tmp_path / "micro")
    assert main(["plan", "--goodput", "--gpus", "512", "--from", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "0.00B" not in out and "127K params x 12 B" in out
    notes = [line for line in out.splitlines() if line.startswith("  note: ")]
    assert any(n.startswith("  note: write_fixed_s measured 0.12 s at 1 ranks") for n in notes)
    assert any(n.startswith("  note: stall_fixed_s measured 0.005 s at 1 ranks") for n in notes)
    assert any("step time measured 0.14 s on 1 rank(s) (cpu)" in n for n in notes)
    assert any("the config's model (127K parameters) takes" in n for n in notes)
    assert notes[-1] == f"  note: from {run_dir}: no measurement carries over"
    rows = [line for line in out.splitlines()[1:] if line.startswith("  ") and "note:" not in line]
    inputs = rows[: rows.index(next(r for r in rows if r.startswith("  write_fixed_s"))) + 1]
    sources = {line.index(" default") for line in inputs if " default" in line}
    assert len(sources) == 1, inputs  # the sources column starts at one offset
    table = [line for line in out.splitlines() if "%" in line and not line.startswith("  note")]
    assert len({len(line) for line in table if line.startswith(("goodput", "  5-95"))}) == 1


def test_a_group_failure_costs_its_restart_over_the_groups_and_the_survivors_stall():
    """Hardware failures only, each killing one of 8 groups: a failure costs the survivors' stall
    plus the group's time away over 8, nothing is lost and the job never restarts."""
    p = dataclasses.replace(
        plain(3600, 1e-3, 600), groups=8, group_restart_s=600, survivor_stall_s=10
    )
    out = simulate(p, [3600.0], True, 100, seed=3)
    # A failure of a group already away (1 - e^(-600/(8 x 3600)) = 2% of them) extends its
    # absence and stalls nobody: a little less than (10 + 600 / 8) s per hour.
    assert out.mean()[0] == pytest.approx(1 - (10 + 600 / 8) / 3600, abs=1e-3)
    lost = out.lost_fractions(0)
    assert lost["lost_work"] == lost["restart"] == 0
    assert lost["group_restart"] == pytest.approx(600 / 8 / 3600, rel=0.05)
    assert lost["survivor_stall"] == pytest.approx(10 / 3600, rel=0.05)
    total = out.goodput * p.horizon_s + out.lost.sum(axis=0)
    assert np.allclose(total, p.horizon_s, rtol=1e-9) and (out.lost >= -1e-6).all()


def test_losing_the_last_live_group_restarts_the_whole_job():
    # Two groups away for a day each: most failures find the other one away.
    p = dataclasses.replace(plain(3600, 1.0, 600), groups=2, group_restart_s=86400)
    lost = simulate(p, [600.0], True, 20, seed=0).lost_fractions(0)
    assert lost["restart"] > 0.01 and lost["lost_work"] > 0 and lost["group_restart"] > 0.1


@pytest.fixture(scope="module")
def llama70b_at_16k():
    """The 70B recipe at 16,384 GPUs with 8 replica groups (the config's own section)."""
    cfg = load_config(["configs/llama-70b.yaml"], ["fault_tolerance.groups=8"])
    return plan_goodput(cfg, 16_384, trials=20)


def test_replica_groups_beat_plain_restarts_for_the_70b_at_16k(llama70b_at_16k):
    plan = llama70b_at_16k
    ft, plain_cr = plan.ft, plan.plain
    assert plan.src.sources["replica_groups"] == "config: fault_tolerance.groups"
    assert ft.goodput > plain_cr.goodput + 0.05 and ft.goodput > plan.healing.goodput
    # The peers hold the work since the last checkpoint: only whole-job restarts lose any.
    assert ft.lost["lost_work"] < plain_cr.lost["lost_work"] / 10
    assert ft.lost["restart"] < plain_cr.lost["restart"] / 5
    assert ft.lost["group_restart"] > 0 and ft.lost["survivor_stall"] > 0
    assert plain_cr.lost["group_restart"] == plain_cr.lost["survivor_stall"] == 0


def test_a_slower_group_restart_costs_goodput(llama70b_at_16k):
    inputs = llama70b_at_16k.src.inputs()
    slower = dataclasses.replace(inputs, ft_restart_s=2 * inputs.ft_restart_s)
    base = run_mode(inputs, True, 20, 0, ft=True)
    slow = run_mode(slower, True, 20, 0, ft=True)
    assert slow.goodput < base.goodput
    assert slow.lost["group_restart"] > 1.5 * base.lost["group_restart"]


def plan_out(capsys, *args: str) -> str:
    argv = ["plan", "configs/llama-70b.yaml", "--goodput", "--gpus", "16384", "--trials", "4"]
    assert main([*argv, *args]) == 0
    return capsys.readouterr().out


def test_the_ft_column_and_json_key_appear_only_with_replica_groups(capsys):
    def header(out: str) -> list[str]:
        return next(line.split() for line in out.splitlines() if "plain C/R" in line)

    assert header(plan_out(capsys)) == ["healing", "plain", "C/R"]  # no FT column
    with_ft = plan_out(capsys, "--set", "replica_groups=16")
    assert header(with_ft) == ["healing", "plain", "C/R", "FT", "groups=16"]
    rows = [r for r in with_ft.splitlines() if r.startswith(("goodput ", "  5-95")) and "%" in r]
    assert {len(row) for row in rows} == {34 + 3 * 13}  # three aligned columns
    assert "  group_restart " in with_ft and "  survivor_stall " in with_ft
    one = json.loads(
        plan_out(capsys, "fault_tolerance.groups=4", "--set", "replica_groups=1", "--json")
    )
    assert "ft" not in one and one["inputs"]["replica_groups"] == 1
    assert one["sources"]["replica_groups"] == "user (--set)"
    four = json.loads(plan_out(capsys, "--set", "replica_groups=4", "--json"))
    assert set(four["ft"]) == set(four["plain"])  # the keys of every mode
    assert set(four["ft"]) <= set(four) and "goodput_at_best" in four["ft"]
    assert four["ft"]["lost_by_cause"]["lost_work"] < four["plain"]["lost_by_cause"]["lost_work"]
