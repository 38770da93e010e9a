"""slurm/train.sbatch on a real single-node SLURM cluster (launch/local-slurm.sh): a job trains to
completion on 2 tasks, and a job requeued mid-run (`scontrol requeue`, then USR1 to the batch shell)
resumes from its checkpoints and ends with the uninterrupted job's weights."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from bigtrain.store.rundir import read_jsonl
from tests.conftest import ROOT

pytestmark = pytest.mark.distributed

SLURM_DIR = Path(os.environ.get("BIGTRAIN_SLURM_DIR", "/tmp/bigtrain-slurm"))


@pytest.fixture(scope="module")
def slurm():
    if os.geteuid() != 0:
        pytest.skip("the local SLURM cluster needs root (munge and slurmd run as root)")
    up = subprocess.run(
        ["bash", "launch/local-slurm.sh", "up"], cwd=ROOT, capture_output=True, text=True
    )
    if up.returncode != 0:
        pytest.skip(f"no local SLURM cluster: {(up.stderr or up.stdout).strip()[-300:]}")
    env = {
        **os.environ,
        "SLURM_CONF": str(SLURM_DIR / "slurm.conf"),
        "WANDB_MODE": "disabled",
        "OMP_NUM_THREADS": "1",
    }
    yield env
    subprocess.run(["bash", "launch/local-slurm.sh", "down"], cwd=ROOT)


def submit(env, out: Path, cache_dir: Path, extra: str = "") -> str:
    overrides = (
        # configs/tiny.yaml's corpus and tokenizer, a narrower model: the jobs test the launch,
        # the signals and the requeue, not the model
        f"data.cache_dir={cache_dir} parallel.backend=fsdp train.max_steps=30 "
        "model.n_layers=2 model.d_model=64 "
        "train.micro_batch_size=8 train.eval_every=10 checkpoint.every=10 wandb.mode=disabled "
        + extra
    )
    result = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--ntasks-per-node=2",
            f"--output={out}.log",
            "slurm/train.sbatch",
        ],
        cwd=ROOT,
        env={**env, "OUT_DIR": str(out), "OVERRIDES": overrides},
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().split(";")[0]


def job(env, job_id: str) -> dict[str, str]:
    text = subprocess.run(
        ["scontrol", "show", "job", job_id], env=env, capture_output=True, text=True
    ).stdout
    return dict(re.findall(r"(\w+)=(\S+)", text))


def wait_for(env, job_id: str, restarts: int = 0, timeout: float = 300) -> dict[str, str]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        info = job(env, job_id)
        done = info.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")
        if done and int(info.get("Restarts", 0)) >= restarts:
            return info
        time.sleep(1)
    raise AssertionError(f"job {job_id} did not finish: {job(env, job_id)}")


def wait_until(env, job_id: str, ready, timeout: float = 200) -> dict[str, str]:
    """The job's fields once `ready(fields)` holds; an error with the last fields at the
    deadline (a loaded machine is slow, not wrong)."""
    deadline = time.time() + timeout
    while not ready(info := job(env, job_id)):
        assert time.time() < deadline, f"job {job_id} never reached the state: {info}"
        time.sleep(0.5)
    return info


def events_of(out: Path, kind: str) -> list[dict]:
    """The run's events of `kind` so far (a line being written is left for the next look)."""
    path, found = out / "events.jsonl", []
    for line in path.read_text().splitlines() if path.is_file() else []:
        with contextlib.suppress(json.JSONDecodeError):
            event = json.loads(line)
            if event["kind"] == kind:
                found.append(event)
    return found


def wait_for_event(out: Path, kind: str, count: int, timeout: float = 200) -> None:
    """Until the run's events hold `count` events of `kind` (a loaded machine is slow)."""
    deadline = time.time() + timeout
    while len(events_of(out, kind)) < count:
        assert time.time() < deadline, f"fewer than {count} {kind!r} events in {out}"
        time.sleep(0.3)


@pytest.fixture(scope="module")
def uninterrupted(slurm, tmp_path_factory, cache_dir):
    out = tmp_path_factory.mktemp("slurm") / "straight"
    info = wait_for(slurm, submit(slurm, out, cache_dir))
    return info, out


def test_sbatch_trains_to_completion_on_two_tasks(uninterrupted):
    info, out = uninterrupted
    assert info["JobState"] == "COMPLETED", info
    final = json.loads((out / "final.json").read_text())
    assert final["step"] == 30
    start = read_jsonl(out / "events.jsonl")[0]
    assert start["world_size"] == 2 and start["backend"] == "fsdp"
    assert "resume" not in [e["kind"] for e in read_jsonl(out / "events.jsonl")]


def test_a_job_requeued_twice_resumes_bit_exactly(slurm, uninterrupted, tmp_path, cache_dir):
    """Requeued after its first checkpoint by `scontrol requeue` (SIGTERM) and, run again, after
    its first checkpoint of the second run by USR1 to the batch shell (what
    --signal=B:USR1@120 does before the time limit): each time it checkpoints, is requeued and
    resumes from that checkpoint; the job ends with the uninterrupted job's weights."""
    out = tmp_path / "requeued"
    job_id = submit(slurm, out, cache_dir, "checkpoint.every=5")
    wait_for_event(out, "checkpoint", 1)
    subprocess.run(["scontrol", "requeue", job_id], env=slurm, check=True)
    wait_for_event(out, "resume", 1)
    checkpoints = len(events_of(out, "checkpoint"))  # the preemption's and those before it
    wait_for_event(out, "checkpoint", checkpoints + 1)  # one of the second run
    subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], env=slurm, check=True)
    info = wait_for(slurm, job_id, restarts=2)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "2", info
    preempts, resumes = events_of(out, "preempt"), events_of(out, "resume")
    assert [("SIGTERM" in p["reason"], "SIGUSR1" in p["reason"]) for p in preempts] == [
        (True, False),
        (False, True),
    ], preempts
    assert [r["slurm_restart_count"] for r in resumes] == [1, 2]
    for preempt, resume in zip(preempts, resumes, strict=True):
        assert resume["path"].endswith(f"step_{preempt['step']:08d}")
    assert preempts[0]["step"] < preempts[1]["step"] < 30
    final = json.loads((out / "final.json").read_text())
    straight = json.loads((uninterrupted[1] / "final.json").read_text())
    assert final["step"] == 30 and final["fingerprint"] == straight["fingerprint"]


def test_a_hung_job_is_requeued_and_finishes(slurm, uninterrupted, tmp_path, cache_dir):
    """Rank 1 hangs at step 15 (once per run directory): the watchdogs end both tasks with exit 5
    and their stacks; the job requeues itself, resumes from step 10 and ends like the one that
    never hung."""
    out = tmp_path / "hang"
    extra = "drill.rank=1 drill.hang_step=[15] resilience.hang_timeout_s=5 parallel.timeout_s=120"
    job_id = submit(slurm, out, cache_dir, extra)
    info = wait_for(slurm, job_id, restarts=1)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", info
    assert (out / "hang" / "rank_1.txt").read_text().startswith("rank 1: no step ended")
    kinds = [e["kind"] for e in read_jsonl(out / "events.jsonl")]
    assert "hang" in kinds and "resume" in kinds
    final = json.loads((out / "final.json").read_text())
    straight = json.loads((uninterrupted[1] / "final.json").read_text())
    assert final["step"] == 30 and final["fingerprint"] == straight["fingerprint"]


def test_repeated_transient_faults_requeue_the_job_without_the_host(slurm, tmp_path, cache_dir):
    out = tmp_path / "suspect"
    extra = "drill.transient_nan_step=[3] resilience.max_transient_per_rank=1"
    job_id = submit(slurm, out, cache_dir, extra)
    host = out / "excluded_hosts.txt"
    # The exclusion appears while the job still ends its first run (COMPLETING); wait for the
    # state the requeue leads to, not for the first moment the exclusion shows.
    info = wait_until(
        slurm,
        job_id,
        lambda i: i.get("ExcNodeList", "(null)") != "(null)" and i.get("JobState") == "PENDING",
    )
    subprocess.run(["scancel", job_id], env=slurm)  # the one node is excluded: it would wait
    assert info["ExcNodeList"] == host.read_text().split()[0], info
    assert info["JobState"] == "PENDING", info
    # excluded at its first requeue (the requeue once ended the script before the exclusion,
    # and the job looped on the host until an exclusion happened to get through)
    assert info["Restarts"] == "1", info


def test_ft_sbatch_relaunches_only_the_failed_groups_step(slurm, tmp_path, cache_dir):
    """slurm/ft.sbatch: the lighthouse in the batch shell, one job step per replica group; group
    1's step dies by SIGKILL at step 5, the script launches it again, it rejoins from group 0,
    and both end with the same weights."""
    out = tmp_path / "ft"
    overrides = (
        f"data.cache_dir={cache_dir} parallel.backend=fsdp train.max_steps=25 model.n_layers=2 "
        "model.d_model=64 train.micro_batch_size=8 train.eval_every=0 checkpoint.every=10 "
        "wandb.mode=disabled train.log_every=1 drill.kill_group=1 drill.kill_step=5 "
        "drill.slow_rank=0 drill.slow_s=0.4 fault_tolerance.heartbeat_timeout_s=1"
    )
    result = subprocess.run(
        ["sbatch", "--parsable", "--ntasks=2", f"--output={out}.log", "slurm/ft.sbatch"],
        cwd=ROOT,
        env={**slurm, "OUT_DIR": str(out), "OVERRIDES": overrides, "FT_GROUPS": "2"},
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    info = wait_for(slurm, result.stdout.strip().split(";")[0])
    log = Path(f"{out}.log").read_text()
    assert info["JobState"] == "COMPLETED", log[-3000:]
    assert "bigtrain-ft: group 1 failed" in log and "group 0 failed" not in log
    assert "bigtrain-ft: all 2 groups finished" in log
    events = read_jsonl(out / "events.jsonl")
    finish = {e["group"]: e["fingerprint"] for e in events if e["kind"] == "finish"}
    assert sorted(finish) == [0, 1] and len(set(finish.values())) == 1
    assert any(e["kind"] == "group_joined" and e["group"] == 1 and e["step"] > 5 for e in events)
