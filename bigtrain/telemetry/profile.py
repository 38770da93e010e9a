"""Profiler traces of chosen steps (`profile.*`) and the loop's phases as named ranges in them.

The loop marks its phases through `Trainer.ranges`: `begin(name)` ends the open range and opens
the next, `end()` closes it. Off (the default) that is `NO_RANGES`, whose methods do nothing: no
profiler object exists and a step pays a few empty method calls (bench/profile_off.py measures
it). While a profiling window is ahead, callbacks/profiler.py puts a `PhaseRanges` there, whose
ranges are torch.profiler.record_function ranges (user annotations in the trace).

The window: `profile.steps = [start, end]` becomes torch.profiler.schedule(wait, warmup, active)
counted from the first step this process runs, so a resumed run profiles the same steps.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from bigtrain.config.telemetry import ProfileConfig

PHASES = ("data", "forward_backward", "monitor", "clip", "optimizer", "checkpoint_copy")
"""The loop's ranges in a step's trace (checkpoint_save: a checkpoint callback's save)."""
FOLDER = "profile"


class NoRanges:
    """Profiling off: the loop's range marks cost an empty call each."""

    def begin(self, name: str) -> None: ...

    def end(self) -> None: ...


NO_RANGES = NoRanges()


class PhaseRanges:
    """The loop's phases as record_function ranges; at most one is open at a time."""

    def __init__(self) -> None:
        self.open: torch.profiler.record_function | None = None

    def begin(self, name: str) -> None:
        self.end()
        self.open = torch.profiler.record_function(name)
        self.open.__enter__()

    def end(self) -> None:
        if self.open is not None:
            self.open.__exit__(None, None, None)
            self.open = None


@dataclass(frozen=True)
class Window:
    """The steps one process profiles: torch.profiler.schedule's numbers for them."""

    start: int
    """The first recorded step (later than profile.steps[0] when the run started later)."""
    end: int
    wait: int
    warmup: int

    @property
    def active(self) -> int:
        return self.end - self.start + 1

    @property
    def first_step(self) -> int:
        """The first step that runs under the profiler (warm-up included)."""
        return self.start - self.warmup


def profile_window(cfg: ProfileConfig, start_step: int) -> Window | None:
    """The window for a process whose first step is `start_step` + 1; None when profile.steps is
    empty or already behind it."""
    if not cfg.steps:
        return None
    first = start_step + 1
    start, end = max(cfg.steps[0], first), cfg.steps[1]
    if end < first:
        return None
    warmup = min(cfg.warmup, start - first)
    return Window(start, end, wait=start - first - warmup, warmup=warmup)


def activities() -> list[torch.profiler.ProfilerActivity]:
    """CPU, and CUDA where a GPU is present."""
    found = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        found.append(torch.profiler.ProfilerActivity.CUDA)
    return found


def trace_path(run_dir: Path, rank: int, window: Window, gzip: bool) -> Path:
    """RUN_DIR/profile/rank<r>.<start>.pt.trace.json[.gz]: the name TensorBoard's profiler plugin
    reads as worker `rank<r>`, span `<start>`."""
    return run_dir / FOLDER / f"rank{rank}.{window.start}.pt.trace.json{'.gz' if gzip else ''}"


def make_profiler(cfg: ProfileConfig, window: Window, on_trace_ready) -> torch.profiler.profile:
    """The profiler of `window`, counting bigtrain's own step numbers: the trace's
    `ProfilerStep#N` is step N. (torch counts from 0 at start(); its schedule is given in
    absolute steps, skipping those before the first this process runs.)"""
    first = window.first_step - window.wait  # the first step this process runs
    schedule = torch.profiler.schedule(
        skip_first=first, wait=window.wait, warmup=window.warmup, active=window.active, repeat=1
    )
    profiler = torch.profiler.profile(
        activities=activities(),
        schedule=schedule,
        on_trace_ready=on_trace_ready,
        record_shapes=cfg.record_shapes,
        with_stack=cfg.with_stack,
    )
    profiler.step_num = first
    profiler.current_action = schedule(first)
    return profiler


KINETO_LINES = ("USDT:", "STAGE:")
"""What the profiler's C++ side (Kineto) writes to the process's stderr at each transition."""


@contextlib.contextmanager
def without_kineto_lines() -> Iterator[None]:
    """Around the profiler's start, step and stop: its native lines (KINETO_LINES) do not reach
    the console; anything else written to stderr meanwhile is passed on after."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            for line in captured.read().decode(errors="replace").splitlines(keepends=True):
                if not line.startswith(KINETO_LINES):
                    sys.stderr.write(line)
            sys.stderr.flush()
