"""The run directory's lock: one live run per directory, stale locks taken over."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bigtrain.checkpoint.manifest import verify
from bigtrain.errors import ConfigError
from bigtrain.store.rundir import read_jsonl
from bigtrain.store.runlock import LOCK_NAME, RunLock, _process_start, owner_record
from tests.conftest import ROOT, run_cli


def _write_lock(run_dir: Path, **owner) -> Path:
    path = run_dir / LOCK_NAME
    path.write_text(json.dumps({**owner_record(), **owner}))
    return path


@pytest.mark.unit
def test_acquire_writes_the_owner_and_release_removes_it(tmp_path):
    lock = RunLock(tmp_path, timeout_s=60).acquire()
    owner = json.loads((tmp_path / LOCK_NAME).read_text())
    assert owner["pid"] == os.getpid() and owner["host"] == lock.owner["host"]
    assert lock.taken_over is None
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


@pytest.mark.unit
def test_a_live_process_on_this_host_keeps_its_lock(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.2)
        _write_lock(tmp_path, pid=sleeper.pid, process_start=_process_start(sleeper.pid))
        with pytest.raises(ConfigError, match=f"in use by a live run .*pid {sleeper.pid}"):
            RunLock(tmp_path, timeout_s=60).acquire()
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == sleeper.pid
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.unit
def test_a_dead_process_lock_is_taken_over(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _write_lock(tmp_path, pid=dead.pid, process_start="1")
    lock = RunLock(tmp_path, timeout_s=60).acquire()
    try:
        assert lock.taken_over is not None and lock.taken_over.owner["pid"] == dead.pid
        assert "no longer runs" in lock.taken_over.reason
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    finally:
        lock.release()


@pytest.mark.unit
def test_a_reused_pid_does_not_keep_a_dead_runs_lock(tmp_path):
    # our own parent's pid is alive, but was started at another time than the lock says
    _write_lock(tmp_path, pid=os.getppid(), process_start="12345")
    lock = RunLock(tmp_path, timeout_s=60).acquire()
    assert "another process" in lock.taken_over.reason
    lock.release()


@pytest.mark.unit
def test_another_hosts_lock_is_taken_over_after_its_heartbeat_stops(tmp_path):
    path = _write_lock(tmp_path, host="node-7", pid=4242)
    old = time.time() - 30
    os.utime(path, (old, old))
    lock = RunLock(tmp_path, timeout_s=10).acquire()
    assert lock.taken_over.owner["host"] == "node-7" and "no heartbeat" in lock.taken_over.reason
    lock.release()
    # a fresh lock of a dead host: watched until it is timeout_s old, then taken
    _write_lock(tmp_path, host="node-7", pid=4242)
    started = time.monotonic()
    lock = RunLock(tmp_path, timeout_s=1.0).acquire(poll_s=0.1)
    assert 0.8 <= time.monotonic() - started < 5 and lock.taken_over is not None
    lock.release()


@pytest.mark.unit
def test_another_hosts_lock_with_a_heartbeat_is_live(tmp_path):
    path = _write_lock(tmp_path, host="node-7", pid=4242)
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(0.1):
            os.utime(path)

    thread = threading.Thread(target=beat)
    thread.start()
    try:
        with pytest.raises(ConfigError, match="host node-7, pid 4242"):
            RunLock(tmp_path, timeout_s=5).acquire(poll_s=0.3)
    finally:
        stop.set()
        thread.join()


@pytest.mark.unit
def test_heartbeat_refreshes_the_lock(tmp_path):
    lock = RunLock(tmp_path, timeout_s=0.4).acquire()
    path = tmp_path / LOCK_NAME
    old = time.time() - 100
    os.utime(path, (old, old))
    # The heartbeat thread runs every 0.1 s; a loaded machine may run it late, not never.
    deadline = time.time() + 30
    while time.time() - path.stat().st_mtime > 1 and time.time() < deadline:
        time.sleep(0.05)
    assert time.time() - path.stat().st_mtime < 1
    lock.release()


@pytest.mark.e2e
def test_a_second_run_on_a_live_run_dir_exits_2_and_changes_nothing(micro_args, tmp_path):
    # The first run holds the lock while it trains (0.3 s a step for up to 400 steps: longer
    # than the second takes to start and ask for it, also on a loaded machine); once the second
    # is refused, the first is preempted (SIGTERM: a checkpoint, exit 4), which its lock survives
    # intact until it lets go.
    args = micro_args("drill.slow_rank=0", "drill.slow_s=0.3", "train.max_steps=400")
    env = {**os.environ, "WANDB_SILENT": "true"}
    first = subprocess.Popen(
        [sys.executable, "-m", "bigtrain", "train", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out = tmp_path / "run"
    deadline = time.time() + 120
    while not (out / LOCK_NAME).exists() and first.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    second = run_cli("train", *args)
    first.send_signal(signal.SIGTERM)
    _, err = first.communicate(timeout=300)
    assert first.returncode == 4, err[-2000:]  # preempted after its checkpoint
    assert second.returncode == 2
    assert f"pid {first.pid}" in second.stderr and "in use by a live run" in second.stderr
    assert "Traceback" not in second.stderr
    checkpoints = sorted((out / "checkpoints").glob("step_*"))
    assert checkpoints  # the preemption's
    for path in checkpoints:
        verify(path)
    assert not list((out / "checkpoints").glob(".replaced-*"))
    steps = [m["step"] for m in read_jsonl(out / "metrics.jsonl")]
    assert steps == sorted(steps) and len(steps) == len(set(steps))
    assert not (out / LOCK_NAME).exists()  # released at the end


@pytest.mark.e2e
def test_a_killed_runs_lock_is_taken_over_with_an_event(micro, tmp_path):
    from bigtrain.parallel.env import DistEnv
    from bigtrain.runner import run

    out = tmp_path / "run"
    out.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _write_lock(out, pid=dead.pid, process_start="1")
    run(micro("train.max_steps=2", "checkpoint.every=-1"), DistEnv())
    takeover = [e for e in read_jsonl(out / "events.jsonl") if e["kind"] == "lock_takeover"]
    assert len(takeover) == 1 and takeover[0]["previous"]["pid"] == dead.pid


@pytest.mark.e2e
def test_out_dir_that_is_a_file_exits_2(micro_args, tmp_path):
    target = tmp_path / "afile"
    target.write_text("precious\n")
    result = run_cli("train", *micro_args(f"train.out_dir={target}"))
    assert result.returncode == 2
    assert "train.out_dir" in result.stderr and "existing file" in result.stderr
    assert "Traceback" not in result.stderr
    assert target.read_text() == "precious\n"


def _refused_run(args: list[str]) -> str:
    """A rank's run on a busy run directory: the error it stopped with."""
    from bigtrain.config import load_config
    from bigtrain.parallel.env import read_env
    from bigtrain.runner import run

    try:
        run(load_config([], args), read_env())
    except ConfigError as e:
        return str(e)
    return "ran"


@pytest.mark.distributed
def test_every_rank_of_a_second_fsdp_run_exits_2(micro_args, tmp_path):
    from tests.distributed import run_distributed

    out = tmp_path / "run"
    out.mkdir()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        time.sleep(0.2)
        _write_lock(out, pid=sleeper.pid, process_start=_process_start(sleeper.pid))
        errors = run_distributed(_refused_run, 2, micro_args("parallel.backend=fsdp"))
    finally:
        sleeper.kill()
        sleeper.wait()
    assert all(f"pid {sleeper.pid}" in e and "in use by a live run" in e for e in errors)
    assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]  # nothing written
