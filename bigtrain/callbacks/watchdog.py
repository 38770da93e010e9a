"""Hang watchdog: a thread per rank that expects a step boundary within a timeout.

A rank stuck in a collective, a dead peer, a deadlocked data loader or a wedged GPU would otherwise
hold the job until the scheduler's time limit. When no step has ended for `resilience.hang_timeout_s`
(default: 10x the median step time, at least 300 s, once 20 steps have run; parallel.timeout_s
before that), the watchdog thread writes every thread's Python stack to RUN_DIR/hang/rank_<r>.txt
(and on NCCL the flight recorder's trace, kept from the start through TORCH_NCCL_TRACE_BUFFER_SIZE),
appends a `hang` event from this rank, and ends the process with exit 5: requeue me (SLURM) or
restart (torchrun). The other ranks, waiting for this one, time out the same way: the watchdog
waits a grace period (min(10 s, timeout / 2)) before it ends its process, so that the other ranks'
watchdogs, whose clocks started at the same step boundary, dump their stacks too before a dead
peer breaks their collectives; and an error in a process whose watchdog has fired ends it with
exit 5 as well (`hang_declared`), not as a crash.

A thread needs the GIL to run: where the stuck code holds it (C code that never releases it),
faulthandler's own C thread dumps the stacks 30 s later into the rank's log file (RUN_DIR/logs/
rank_<r>.log, after its last lines) and ends the process (exit 1), so a hang never outlives its
timeout by more than a minute either way. That file is open from the start (the C thread can
make no directory), so RUN_DIR/hang/ exists only where a hang wrote its stacks.
"""

from __future__ import annotations

import faulthandler
import os
import statistics
import threading
import time
from collections import deque
from pathlib import Path

import torch

from bigtrain.config.schema import ResilienceConfig
from bigtrain.errors import HANG_EXIT_CODE
from bigtrain.train.hooks import Callback
from bigtrain.train.step import StepResult

WARM_STEPS = 20  # steps before the timeout follows the measured step time
MIN_TIMEOUT_S = 300.0
BACKSTOP_S = 30.0  # faulthandler's C watchdog fires this long after the Python one should have
NCCL_TRACE_ENV = "TORCH_NCCL_TRACE_BUFFER_SIZE"
FIRING = threading.Event()  # this process's watchdog found a hang
DECLARED = threading.Event()  # ... and has written its stacks and its event


def hang_declared(wait_s: float = 30.0) -> bool:
    """Whether this process's watchdog found a hang (then wait until it has written its report)."""
    if not FIRING.is_set():
        return False
    DECLARED.wait(wait_s)
    return True


def enable_nccl_flight_recorder(entries: int = 2000) -> None:
    """Keep the last collectives' records (set before the process group starts); dumped on a hang."""
    os.environ.setdefault(NCCL_TRACE_ENV, str(entries))


class HangWatchdog(Callback):
    def __init__(
        self,
        cfg: ResilienceConfig,
        startup_timeout_s: float,
        rank: int,
        hang_dir: Path,
        log_path: Path,
    ) -> None:
        """`hang_dir`: where a hang's stacks go (made then); `log_path`: the rank's log file,
        which faulthandler's backstop appends its stacks to."""
        self.cfg, self.startup_timeout_s, self.rank = cfg, startup_timeout_s, rank
        self.hang_dir, self.log_path = hang_dir, log_path
        self.step_times: deque[float] = deque(maxlen=200)
        self.last_beat = time.monotonic()
        self.step = 0
        self.trainer = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._backstop_file = None

    def timeout_s(self) -> float:
        if self.cfg.hang_timeout_s is not None:
            return self.cfg.hang_timeout_s
        if len(self.step_times) < WARM_STEPS:
            return self.startup_timeout_s
        return max(MIN_TIMEOUT_S, 10 * statistics.median(self.step_times))

    def on_start(self, trainer) -> None:
        self.trainer, self.step = trainer, trainer.step
        self.beat()
        self._thread = threading.Thread(target=self._watch, name="bigtrain-watchdog", daemon=True)
        self._thread.start()

    def on_step_end(self, trainer, result: StepResult) -> None:
        self.step = trainer.step
        self.step_times.append(result.step_time)
        self.beat()

    def on_finish(self, trainer) -> None:
        self.close()  # final.json and the fingerprint follow; no more step boundaries

    def beat(self) -> None:
        """A step ended: restart both clocks."""
        self.last_beat = time.monotonic()
        timeout = self.timeout_s()
        if self._backstop_file is None:
            self._backstop_file = open(self.log_path, "a")  # noqa: SIM115
        faulthandler.dump_traceback_later(
            timeout + BACKSTOP_S, repeat=False, file=self._backstop_file, exit=True
        )

    def _watch(self) -> None:
        while not self._stop.wait(1.0):
            waited = time.monotonic() - self.last_beat
            if waited > self.timeout_s():
                self._fire(waited)

    def _fire(self, waited: float) -> None:
        FIRING.set()
        self.hang_dir.mkdir(parents=True, exist_ok=True)
        path = self.hang_dir / f"rank_{self.rank}.txt"
        with open(path, "w") as f:
            f.write(f"rank {self.rank}: no step ended for {waited:.0f} s after step {self.step}\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        details = {"rank": self.rank, "waited_s": round(waited, 1), "stacks": str(path)}
        trace = dump_nccl_trace(self.hang_dir / f"nccl_rank_{self.rank}.pkl")
        if trace:
            details["nccl_trace"] = trace
        if self.trainer is not None:  # the step it hung in
            step = self.trainer.step_in_progress or self.step + 1
            self.trainer.run_dir.event(step, "hang", any_rank=True, **details)
        DECLARED.set()
        time.sleep(min(10.0, self.timeout_s() / 2))  # the other ranks' watchdogs fire meanwhile
        os._exit(HANG_EXIT_CODE)

    def close(self) -> None:
        self._stop.set()
        faulthandler.cancel_dump_traceback_later()
        if self._backstop_file is not None:
            self._backstop_file.close()
            self._backstop_file = None


def dump_nccl_trace(path: Path) -> str | None:
    """The NCCL flight recorder's records, where the process group keeps them (CUDA)."""
    if not torch.cuda.is_available():
        return None
    try:
        from torch._C._distributed_c10d import _dump_nccl_trace

        path.write_bytes(_dump_nccl_trace())
    except (ImportError, RuntimeError, AttributeError):
        return None
    return str(path)
