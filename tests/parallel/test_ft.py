"""Fault-tolerant replica groups (parallel/ft.py) through launch/ft.sh: separate jobs on gloo that
average their gradients over torchft's managed group, survive a killed group, and heal together.

Every run is FP32 so that the FT run and the plain fsdp run with the same data-parallel size can
be held to 1e-5: the two sum the same gradients in a different order (a mean within the group,
then over the groups, against one mean over all ranks), which FP32 rounds alike to ~1e-7."""

from __future__ import annotations

import json
import statistics
import subprocess

import pytest

from bigtrain.parallel.env import free_port
from bigtrain.store.rundir import read_jsonl
from bigtrain.telemetry.report import build_report
from tests import test_launchers as launchers

pytestmark = pytest.mark.distributed

FP32 = ("precision.compute_dtype=fp32", "train.log_every=1", "checkpoint.every=5")


def launch(cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """The launchers' subprocess (tests/test_launchers.py), which must succeed."""
    result = launchers.launch(cmd, timeout)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def ft(groups: int, nproc: int, args: list[str], log_dir, *extra: str) -> None:
    """A run of `groups` replica groups of `nproc` ranks through launch/ft.sh."""
    env_log = f"FT_LOG_DIR={log_dir}"
    launch(
        [
            "env",
            env_log,
            "bash",
            "launch/ft.sh",
            "--groups",
            str(groups),
            "--nproc-per-group",
            str(nproc),
            "--max-restarts",
            "1",
            *args,
            "parallel.backend=fsdp",
            "fault_tolerance.heartbeat_timeout_s=1",
            *extra,
        ]
    )


def plain(world: int, args: list[str]) -> None:
    launch(
        [
            "torchrun",
            "--nproc-per-node",
            str(world),
            "--master-port",
            str(free_port()),
            "-m",
            "bigtrain",
            "train",
            *args,
            "parallel.backend=fsdp",
        ]
    )


def losses(out) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r}


def events(out, kind: str) -> list[dict]:
    return [e for e in read_jsonl(out / "events.jsonl") if e["kind"] == kind]


def finishes(out, groups: int) -> dict[int, dict]:
    done = {e["group"]: e for e in events(out, "finish")}
    assert sorted(done) == list(range(groups)), f"finish events of groups {sorted(done)}"
    return done


def assert_close(a: dict[int, float], b: dict[int, float], tol: float = 1e-5) -> None:
    assert sorted(a) == sorted(b)
    worst = max(abs(a[s] - b[s]) / abs(b[s]) for s in a)
    assert worst <= tol, f"largest relative loss difference {worst:.2e} > {tol}"


@pytest.mark.parametrize("groups,nproc", [(3, 1), (2, 2)])
def test_fault_free_groups_train_as_the_plain_run_of_the_same_data_parallel_size(
    micro_args, tmp_path, groups, nproc
):
    """G groups of R ranks, all taking part from the first step (min_groups=G), give the plain
    fsdp run of G x R ranks' per-step losses; every group ends with the same weights."""
    steps = ("train.max_steps=8",)
    ft_out, plain_out = tmp_path / "ft", tmp_path / "plain"
    ft(
        groups,
        nproc,
        micro_args(*FP32, *steps, out="ft"),
        tmp_path / "logs",
        f"fault_tolerance.min_groups={groups}",
    )
    plain(groups * nproc, micro_args(*FP32, *steps, out="plain"))
    assert_close(losses(ft_out), losses(plain_out))
    assert len(losses(ft_out)) == 8
    prints = {e["fingerprint"] for e in finishes(ft_out, groups).values()}
    assert len(prints) == 1
    assert not events(ft_out, "commit_failed") and not events(ft_out, "group_joined")
    quorum = events(ft_out, "quorum")
    assert {tuple(e["participants"]) for e in quorum} == {tuple(range(groups))}
    assert sorted(p.name for p in (ft_out / "checkpoints").iterdir()) == [
        "step_00000005",
        "step_00000008",
    ]


def test_a_killed_or_preempted_group_restarts_alone_and_rejoins_from_a_live_peer(
    micro_args, tmp_path
):
    """Group 1 dies by SIGKILL inside step 12: the step is not committed anywhere, the two
    survivors commit every later step without it, group 1 restarts under torchrun, takes the
    whole state from a peer and finishes with the same weights; no token is trained twice and
    its missed slices are counted. Then SIGTERM reaches group 2 at step 32: it stops (exit 4)
    without stopping the others, torchrun starts it again and it rejoins too."""
    out = tmp_path / "run"
    args = micro_args(
        *FP32,
        "train.max_steps=60",
        "fault.kill_group=1",
        "fault.kill_step=12",
        "fault.group=2",
        "fault.sigterm_step=32",
        # slow steps, so that the killed group's restart (a new interpreter, ~5-10 s here)
        # comes back before the survivors finish
        "fault.slow_rank=0",
        "fault.slow_s=0.4",
    )
    ft(3, 1, args, tmp_path / "logs")
    done = finishes(out, 3)
    assert len({e["fingerprint"] for e in done.values()}) == 1
    kill, sigterm = events(out, "fault")
    assert kill["type"] == "kill_group" and kill["group"] == 1 and kill["step"] == 12
    assert sigterm["type"] == "sigterm" and sigterm["group"] == 2 and sigterm["step"] == 32
    failed = {e["step"] for e in events(out, "commit_failed")}
    assert 12 in failed and failed <= {12, 33}
    assert {e["group"] for e in events(out, "commit_failed") if e["step"] == 12} <= {0, 2}
    # the preemption stopped group 2 alone; it came back
    assert {e["group"] for e in events(out, "preempt")} == {2}
    assert any(e["group"] == 2 and e["time"] > sigterm["time"] for e in events(out, "group_joined"))
    # (a group that starts late joins at its first step too: only the join after the kill)
    joined = [
        e for e in events(out, "group_joined") if e["group"] == 1 and e["time"] > kill["time"]
    ]
    assert len(joined) == 1 and joined[0]["bytes"] > 0
    # the survivors committed every step: each step has one metrics line (the leader's)
    curve = losses(out)
    assert sorted(curve) == list(range(1, 61))
    # continuous: no stretch climbs back as a restart from scratch would (loss ~5.9 here against
    # ~5 before the kill; a median over 5 steps, as a single step of the micro model on CPU can
    # lie up to ~1.5x above its neighbours, see the issue note)
    before = statistics.median(curve[s] for s in range(9, 12))
    for start in range(12, 57):
        stretch = statistics.median(curve[s] for s in range(start, start + 5))
        assert stretch < before * 1.1, (start, before, curve)
    skipped = done[0]["tokens_skipped_by_group"]
    missed = joined[0]["step"] - 12  # steps 12 .. joined-1 ran without group 1 (and maybe more)
    per_group = 8 * 32  # micro batch x seq_len
    assert skipped["1"] >= missed * per_group and skipped["1"] % per_group == 0
    assert done[0]["tokens"] + sum(skipped.values()) == 60 * 3 * per_group
    # the report: the quorum's size over time and the failure's costs
    build_report(out)
    plotted = json.loads((out / "report" / "plotted.json").read_text())["quorum"]
    after_kill = [r for r in plotted["failures"] if r["step"] == 12]
    (lost,) = [r for r in after_kill if r["group"] == 1]
    assert lost["away_s"] > lost["survivors_stall_s"] > 0
    assert 2.0 in plotted["groups in the quorum"]["y"]


def test_a_group_joining_during_a_rollback_cooldown_takes_the_backed_off_state(
    micro_args, tmp_path
):
    """A NaN gradient in group 0 only at step 6: the reduced numbers are NaN in every group, so
    all three replay (reproduced: a data fault), roll back to the same target and keep the
    trajectory of the plain fsdp run of 3 ranks with the same NaN on its rank 0 (compared up to
    step 7). Group 2 then dies at step 8, right after the rollback, and rejoins while the LR is
    still backed off: it receives the lowered LR scale and the healer's windows with the
    weights, and every group ends equal."""
    out, plain_out = tmp_path / "run", tmp_path / "plain"
    healing = ("fault.nan_grad_step=[6]", "resilience.lr_cooldown_steps=200")
    args = micro_args(
        *FP32,
        *healing,
        "train.max_steps=50",
        "fault.kill_group=2",
        "fault.kill_step=8",
        "fault.slow_rank=0",
        "fault.slow_s=0.4",
    )
    ft(3, 1, args, tmp_path / "logs")
    plain(3, micro_args(*FP32, *healing, "train.max_steps=7", "fault.rank=0", out="plain"))
    done = finishes(out, 3)
    assert len({e["fingerprint"] for e in done.values()}) == 1
    rollbacks = events(out, "rollback")
    assert {e["group"] for e in rollbacks} == {0, 1, 2}
    assert {(e["from_step"], e["to_step"]) for e in rollbacks} == {
        (r["from_step"], r["to_step"]) for r in events(plain_out, "rollback")
    }
    before_kill = {s: v for s, v in losses(out).items() if s <= 7}
    assert_close(before_kill, losses(plain_out))
    (kill,) = [e for e in events(out, "fault") if e["type"] == "kill_group"]
    (joined,) = [
        e for e in events(out, "group_joined") if e["group"] == 2 and e["time"] > kill["time"]
    ]
    assert joined["step"] >= 8
    # the joined group's own view: the back-off came with the state (no lr_restore anywhere)
    assert not events(out, "lr_restore")
    assert all(e["rollbacks"] == 1 for e in done.values())


def test_the_whole_job_restarts_from_its_checkpoint_with_another_number_of_groups(
    micro_args, tmp_path
):
    """Three groups stop at step 6 (the leading group writes the checkpoint); the job comes
    back as two groups, resumes from it with the same global batch (24 sequences: micro-batch
    6 x 2 steps of accumulation on each of the two groups) and finishes with equal weights."""
    out = tmp_path / "run"
    ft(
        3,
        1,
        micro_args(*FP32, "train.max_steps=10", "train.stop_at_step=6"),
        tmp_path / "logs3",
        "fault_tolerance.min_groups=3",
    )
    assert sorted(p.name for p in (out / "checkpoints").iterdir())[-1] == "step_00000006"
    ft(
        2,
        1,
        micro_args(*FP32, "train.max_steps=10"),
        tmp_path / "logs2",
        "fault_tolerance.min_groups=2",
    )
    resumed = events(out, "resume")
    assert sorted(e["group"] for e in resumed) == [0, 1]
    assert all(e["step"] == 6 for e in resumed)
    done = finishes(out, 2)
    assert len({e["fingerprint"] for e in done.values()}) == 1
    assert done[0]["tokens"] == 10 * 24 * 32 and "tokens_skipped_by_group" not in done[0]
    assert not events(out, "group_joined")


def test_a_group_of_pipeline_stages_dies_and_rejoins_stage_by_stage(micro_args, tmp_path):
    """Two groups of two pipeline stages (4 processes): group 1 is killed inside step 5, restarts,
    and each of its stages takes the state of the same stage of group 0; both end equal."""
    out = tmp_path / "run"
    args = micro_args(
        *FP32,
        "model.n_layers=4",
        "parallel.pipeline_parallel=2",
        "train.max_steps=30",
        "fault.kill_group=1",
        "fault.kill_step=5",
        "fault.slow_rank=0",
        "fault.slow_s=0.3",
    )
    ft(2, 2, args, tmp_path / "logs")
    done = finishes(out, 2)
    assert len({e["fingerprint"] for e in done.values()}) == 1
    (joined,) = [e for e in events(out, "group_joined") if e["group"] == 1 and e["step"] > 5]
    assert joined["source"] == 0 and joined["bytes"] > 0
