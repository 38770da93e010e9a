"""One live run per run directory: RUN_DIR/.lock, taken by rank 0 before anything is written.

The lock file holds the owner (host, pid, the process's start time, SLURM job, when it started) as
JSON and is refreshed by a heartbeat thread. A second run on the same directory exits 2 naming the
owner. A lock whose owner is gone is taken over, with a `lock_takeover` event:
- same host: the pid no longer runs (or runs another program: its start time differs);
- another host (we cannot look at its processes): no heartbeat for `train.lock_timeout_s`. A
  lock that is still fresh is watched until then; a heartbeat seen meanwhile means it is alive.
Takeover renames the old file aside first (only one contender can), then creates the new one.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bigtrain.errors import ConfigError
from bigtrain.store.rundir import RunDir
from bigtrain.utils.dist import all_gather_objects

LOCK_NAME = ".lock"


def _process_start(pid: int) -> str | None:
    """The kernel's start time of `pid` (clock ticks since boot; tells pid reuse apart), or None
    where /proc is missing."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    return True


def owner_record() -> dict[str, Any]:
    pid = os.getpid()
    return {
        "host": socket.gethostname(),
        "pid": pid,
        "process_start": _process_start(pid),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def describe(owner: dict[str, Any]) -> str:
    job = f", SLURM job {owner['slurm_job_id']}" if owner.get("slurm_job_id") else ""
    return f"host {owner.get('host')}, pid {owner.get('pid')}{job}, started {owner.get('started')}"


@dataclass
class Stale:
    """Why a lock's owner counts as gone."""

    owner: dict[str, Any]
    reason: str


class RunLock:
    def __init__(self, run_dir: Path, timeout_s: float, name: str = LOCK_NAME) -> None:
        self.path = run_dir / name
        self.timeout_s = timeout_s
        self.owner = owner_record()
        self.taken_over: Stale | None = None
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def acquire(self, poll_s: float = 1.0) -> RunLock:
        """Take the lock (taking over a dead owner's), or raise ConfigError naming the live run."""
        while True:
            if self._create():
                break
            current = self._read()
            if current is None:
                continue  # released or renamed aside between our two looks: try again
            if self._is_mine(current):
                break  # this process already holds it (a second run in one process: tests)
            verdict, reason = self._stale(current)
            if verdict is True or (isinstance(verdict, float) and verdict <= 0):
                self._take_over(current, reason)
                continue
            if verdict is False:
                raise self._busy(current)
            # another host, fresh heartbeat: watch it until it beats (alive) or goes stale
            beat = self._mtime()
            time.sleep(min(poll_s, verdict))
            if self._mtime() not in (beat, None):
                raise self._busy(current)
        self._start_heartbeat()
        return self

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(self.owner, f)
        return True

    def _mtime(self) -> float | None:
        try:
            return self.path.stat().st_mtime
        except FileNotFoundError:
            return None

    def _read(self) -> dict[str, Any] | None:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return None
        try:
            owner = json.loads(text)
        except json.JSONDecodeError:  # a writer died between create and write
            owner = None
        return owner if isinstance(owner, dict) else {"unreadable": text[:200]}

    def _is_mine(self, owner: dict[str, Any]) -> bool:
        keys = ("host", "pid", "process_start")
        return all(owner.get(k) == self.owner[k] for k in keys)

    def _stale(self, owner: dict[str, Any]) -> tuple[bool | float, str]:
        """(True: the owner is gone; False: it is alive; a float: another host's lock, seconds
        until its heartbeat is `timeout_s` old), and why it would count as gone."""
        mtime = self._mtime()
        if mtime is None:
            return 0.0, "released meanwhile"  # nothing to take over: try again
        if "unreadable" in owner:
            return self.timeout_s - (time.time() - mtime), "unreadable lock file"
        if owner.get("host") == self.owner["host"]:
            pid = int(owner.get("pid", -1))
            gone = not _alive(pid)
            start = _process_start(pid)
            reused = not gone and start is not None and start != owner.get("process_start")
            if gone or reused:
                why = "pid no longer runs" if gone else "pid now belongs to another process"
                return True, f"{why} on this host"
            return False, ""
        why = f"no heartbeat from host {owner.get('host')} for {self.timeout_s:g} s"
        return self.timeout_s - (time.time() - mtime), why

    def _take_over(self, owner: dict[str, Any], reason: str) -> None:
        aside = self.path.with_name(f"{LOCK_NAME}.stale-{os.getpid()}")
        try:
            os.rename(self.path, aside)  # one contender wins; the others see the new lock
        except FileNotFoundError:
            return
        try:
            moved = json.loads(aside.read_text())
        except (OSError, json.JSONDecodeError):
            moved = None
        if moved is not None and moved != owner and "unreadable" not in owner:
            # Another contender took over between our look and the rename: put its lock back.
            with contextlib.suppress(FileExistsError):
                os.link(aside, self.path)
        else:
            self.taken_over = Stale(owner, reason)
        aside.unlink(missing_ok=True)

    def _busy(self, owner: dict[str, Any]) -> ConfigError:
        return ConfigError(
            f"train.out_dir '{self.path.parent}' is in use by a live run ({describe(owner)}); "
            f"wait for it, stop it, or use another train.out_dir (lock: {self.path})"
        )

    def _start_heartbeat(self) -> None:
        interval = max(min(self.timeout_s / 4, 30.0), 0.05)

        def beat() -> None:
            while not self._stop.wait(interval):
                try:
                    os.utime(self.path)
                except FileNotFoundError:
                    return

        self._beat = threading.Thread(target=beat, name="bigtrain-lock-heartbeat", daemon=True)
        self._beat.start()

    def release(self) -> None:
        """Remove the lock if this process still owns it."""
        self._stop.set()
        if self._beat is not None:
            self._beat.join(timeout=5)
        current = self._read()
        if current is not None and self._is_mine(current):
            self.path.unlink(missing_ok=True)


def lock_run_dir(run_dir: RunDir, timeout_s: float, is_main: bool) -> RunLock | None:
    """Rank 0 locks the run directory; every rank learns whether it could, and all exit 2
    together when another live run holds it. Replica groups share the directory: each locks
    its own part (`.lock.group<g>`), so two processes of one group never run together."""
    lock, error = None, None
    name = LOCK_NAME if run_dir.group is None else f"{LOCK_NAME}.group{run_dir.group}"
    if is_main:
        try:
            lock = RunLock(run_dir.path, timeout_s, name).acquire()
        except ConfigError as e:
            error = str(e)
    error = all_gather_objects(error)[0]
    if error is not None:
        raise ConfigError(error)
    return lock
