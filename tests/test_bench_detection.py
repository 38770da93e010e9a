"""bench/detection.py end to end on its smallest matrix: 2 healthy micro runs of 30 steps, the
simulated fault sweep and the candidates, no real 2-rank validation runs."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch

from bigtrain.monitor.shards import ShardHistory, shard_levels
from tests.conftest import ROOT

ISSUE_KINDS = {"nan_grad", "inf_grad", "nan_loss", "spike_x50", "spike_x10"}


def detection_bench(monkeypatch, capsys, cache_dir, *args: str) -> dict:
    """bench/detection.py --quick ARGS, run in this process (its imports are the suite's, a new
    interpreter would spend ~4 s on them): its JSON report, the last line it prints."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    monkeypatch.setenv("BIGTRAIN_CACHE", str(cache_dir))
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setattr(sys, "argv", ["bench/detection.py", "--quick", *args])
    import detection

    capsys.readouterr()
    detection.main()
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.unit
def test_the_simulated_ranks_shard_statistics_are_the_monitors(monkeypatch):
    """bench/detection_sim.py's NumPy mirror of monitor/shards.py, MAX-reduced over two emulated
    ranks, gives the numbers the monitor's two ranks would (FP32 there, FP64 here), partners
    included: the pair row differs from the alone row once the history holds 3 steps."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    from detection_sim import RankShards

    rng = np.random.default_rng(0)
    sizes = np.array([[4, 4], [3, 0], [2, 2], [5, 5], [6, 6]])  # rank 0 holds tensor 1 whole
    mirror = RankShards(sizes, window=4, neighbours=2)
    ranks = [ShardHistory(4, len(sizes), torch.device("cpu"), neighbours=2) for _ in range(2)]
    base = rng.uniform(0.1, 10.0, sizes.shape)
    for step in range(8):
        halves = base * rng.uniform(0.5, 2.0, sizes.shape) * sizes
        halves[3] = halves[4] * rng.uniform(0.99, 1.01, 2)  # tensor 3 moves like 4
        levels = [
            shard_levels(torch.tensor(halves[:, r]), torch.tensor(sizes[:, r]), 1.0) for r in (0, 1)
        ]
        packed = [ranks[r].statistics(levels[r]) for r in (0, 1)]
        reduced = torch.stack(packed).max(dim=0).values.double().numpy()
        np.testing.assert_allclose(mirror.shards(halves), reduced, rtol=1e-5, atol=1e-5)
        rows = reduced.reshape(4, -1)
        assert (rows[3] != rows[2]).any() == (step >= 3)  # partners from the 3rd accepted step
        mirror.accept(halves)
        for r in (0, 1):
            ranks[r].add(levels[r])
    assert mirror.partner[3].tolist() == [4, 4]
    assert [ranks[r].partners()[0][3].item() for r in (0, 1)] == [4, 4]


@pytest.mark.e2e
def test_detection_bench_reports_the_issues_keys(cache_dir, tmp_path, monkeypatch, capsys):
    sweeps = ["--runs", "2", "--steps", "30", "--short-runs", "1", "--short-steps", "24"]
    saved = str(tmp_path / "traces.pkl")
    report = detection_bench(
        monkeypatch, capsys, cache_dir, *sweeps, "--validate", "0", "--save-traces", saved
    )
    assert report["bench"] == "detection" and report["mode"] == "quick"
    assert (report["healthy_runs"], report["healthy_steps"]) == (3, 2 * 30 + 24)
    assert ISSUE_KINDS <= set(report["detection_rate"]) <= set(report["steps_to_detect"])
    # Non-finite values are always caught, at their own step, on either rank at every step from 2
    # of every run (the short one included).
    for kind in ("nan_grad", "inf_grad", "nan_loss"):
        assert report["detection_rate"][kind] == 1.0
        assert report["steps_to_detect"][kind] == {"0": 2 * (2 * 29 + 23), "missed": 0}
    # The real runs' alarms and the simulation's replay of the same steps agree.
    assert report["false_alarms"] == report["false_alarms_simulated"]
    assert report["validated"] == [0, 0]
    # the router rules are on by default and idle on a dense model
    assert report["rules"]["rules"] == ["loss", "grad_norm", "router_logits", "router_spread"]
    assert len(report["candidates"]) == 6
    # the suspicion tier's keys (issues 40, 49): replays per 1,000 healthy steps over whole runs,
    # one-tensor and bit-flip rates (first execution only: caught by an anomaly or a suspicion's
    # replay), on 2 emulated ranks and on one process
    assert report["transient_verdicts"] == 0
    assert {"grad_spike_x10", "grad_spike_x50", "bitflip"} <= set(report["detection_rate"])
    assert 0.0 <= report["detection_rate"]["bitflip"] <= 1.0
    assert set(report["one_process"]["detection_rate"]) == {"grad_spike_x10", "grad_spike_x50"}
    long, short = report["sweeps"]["long"], report["sweeps"]["short"]
    assert (long["runs"], long["steps"], long["model"]) == (2, 60, "micro")
    assert (short["runs"], short["steps"], short["model"]) == (1, 24, "tiny")
    for key in ("suspicions_per_1k", "suspicions_real_per_1k", "suspicions_one_process_per_1k"):
        whole = sum(s[key] * s["steps"] for s in (long, short)) / report["healthy_steps"]
        assert report[key] == pytest.approx(whole, abs=1e-3)  # over every step of every run
    for sweep in (long, short):  # the replayed steps themselves, by phase of the runs
        assert len(sweep["suspicion_steps"]) == round(
            sweep["suspicions_per_1k"] * sweep["steps"] / 1000
        )
        assert sum(sweep["suspicions_by_phase"].values()) == len(sweep["suspicion_steps"])
        real = sweep["suspicion_steps_real"]
        assert len(real) == round(sweep["suspicions_real_per_1k"] * sweep["steps"] / 1000)
        assert all(1 < step <= 30 and "." in tensor for _, step, tensor in real)
    assert report["rules"]["suspicion"]["lead"] > 1.0
    # Gradient checksums (monitor/checksums.py) check every step of these short runs (until step
    # 200), every tensor of a dense GPT: no healthy residual near the tolerance, and a one-tensor
    # x10 is 0.9 - a healthy residual away from its check, so every one is caught, on 2 emulated
    # ranks and on one process.
    checks = report["checksums"]
    assert checks["checked_steps"] == report["healthy_steps"]
    assert checks["largest_healthy_residual"] < checks["tolerance"] / 3
    for rates in (report["detection_rate"], report["one_process"]["detection_rate"]):
        assert rates["grad_spike_x10"] == rates["grad_spike_x50"] == 1.0
    # The saved traces judged again (how a rule is studied offline): the same simulated numbers,
    # and none of the runs' own, which the recording's rules made.
    again = detection_bench(
        monkeypatch,
        capsys,
        cache_dir,
        *sweeps,
        "--validate",
        "0",
        "--no-candidates",
        "--load-traces",
        saved,
    )
    assert again["runs_trained"] is False and again["suspicions_real_per_1k"] is None
    for key in ("suspicions_per_1k", "suspicions_one_process_per_1k", "detection_rate"):
        assert again[key] == report[key]


@pytest.mark.e2e
def test_detection_bench_on_moe_models_runs_the_router_drill(cache_dir, monkeypatch, capsys):
    """--moe: a healthy MoE micro run with all four rules on, and one real 2-rank run of the
    router-bias drill, caught at its step."""
    report = detection_bench(
        monkeypatch,
        capsys,
        cache_dir,
        "--moe",
        "--runs",
        "1",
        "--steps",
        "30",
        "--validate",
        "0",
        "--router-drills",
        "1",
        "--no-candidates",
        "--short-runs",
        "0",
    )
    assert report["moe"] is True and report["healthy_runs"] == 1
    assert list(report["sweeps"]) == ["long"]
    assert report["rules"]["rules"] == ["loss", "grad_norm", "router_logits", "router_spread"]
    assert report["false_alarms"] == report["false_alarms_simulated"] == 0
    assert {"router_collapse", "router_spread"} <= set(report["healthy_dynamics"])
    assert report["router_bias"] == {"trials": 1, "caught_at_step": 1}
