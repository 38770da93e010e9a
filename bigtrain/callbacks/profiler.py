"""Profiler traces and CUDA memory history over `profile.steps` on `profile.ranks`
(telemetry/profile.py, telemetry/memory.py). Built only where a rank profiles: with profiling off no
profiler object exists.

The profiler starts with the run (waiting, unrecorded, until the warm-up steps), steps once per
optimizer step after every other callback, and writes its trace when the window ends (or the run
ends inside it); a `profile` event from this rank names the files. The loop's phases are named
ranges while the window is ahead (`trainer.use_ranges`), and empty calls again after it."""

from __future__ import annotations

import logging

import torch

from bigtrain.config.telemetry import ProfileConfig
from bigtrain.telemetry import memory
from bigtrain.telemetry.profile import (
    FOLDER,
    NO_RANGES,
    PhaseRanges,
    Window,
    make_profiler,
    profile_window,
    trace_path,
    without_kineto_lines,
)
from bigtrain.train.hooks import Callback
from bigtrain.train.step import StepResult

logger = logging.getLogger(__name__)


class ProfilerCallback(Callback):
    def __init__(self, cfg: ProfileConfig, rank: int) -> None:
        self.cfg, self.rank = cfg, rank
        self.trainer = None
        self.window: Window | None = None
        self.profiler: torch.profiler.profile | None = None
        self.recording_memory = False

    def on_start(self, trainer) -> None:
        self.trainer = trainer
        self.window = profile_window(self.cfg, trainer.step)
        if self.cfg.steps and self.window is None:
            logger.info("profile.steps=%s: already behind step %d", self.cfg.steps, trainer.step)
        # profile.memory: over the window, or from the first step when there is none.
        whole_run = not self.cfg.steps
        ahead = self.window is not None and self.window.first_step <= trainer.step + 1
        if self.cfg.memory and (whole_run or ahead):
            self.recording_memory = memory.start_history(trainer.device)
        if self.window is None:
            return
        (trainer.run_dir.path / FOLDER).mkdir(parents=True, exist_ok=True)
        self.profiler = make_profiler(self.cfg, self.window, self._write)
        with without_kineto_lines():
            self.profiler.start()
        trainer.use_ranges(PhaseRanges())

    def on_step_end(self, trainer, result: StepResult) -> None:
        if self.profiler is None:
            return
        with without_kineto_lines():
            self.profiler.step()  # after the window's last step: the trace is written (_write)
        next_step = trainer.step + 1
        if self.cfg.memory and not self.recording_memory and next_step == self.window.first_step:
            self.recording_memory = memory.start_history(trainer.device)
        if trainer.step >= self.window.end:
            self._stop()

    def _write(self, profiler: torch.profiler.profile) -> None:
        """on_trace_ready: the trace (and the memory snapshot), and the event naming them."""
        window, run_dir = self.window, self.trainer.run_dir.path
        path = trace_path(run_dir, self.rank, window, self.cfg.gzip)
        profiler.export_chrome_trace(str(path))
        files = {"trace": str(path)}
        if self.recording_memory:
            snapshot = path.with_name(f"rank{self.rank}.{window.start}.memory.pickle")
            files["memory_snapshot"] = str(memory.dump_snapshot(snapshot))
            memory.stop_history()
            self.recording_memory = False
        last = min(window.end, self.trainer.step)
        self.trainer.event(
            "profile", any_rank=True, rank=self.rank, steps=[window.start, last], **files
        )

    def _stop(self) -> None:
        """End profiling: a trace not yet written (the run ended inside the window) is now."""
        if self.profiler is not None:
            with without_kineto_lines():
                self.profiler.stop()
            self.profiler = None
            self.trainer.use_ranges(NO_RANGES)

    def on_finish(self, trainer) -> None:
        self._stop()

    def on_stop(self, trainer, reason: str) -> None:
        self._stop()

    def close(self) -> None:
        self._stop()
