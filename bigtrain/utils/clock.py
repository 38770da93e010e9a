"""Clocks for what a failure costs (telemetry/costs.py reads what they record).

`StartupClock`: where the time from process start to the first step goes, by phase. `Tally`: a
count, seconds and bytes of a repeated cost (snapshots). `last_event_time`: when the previous
process of a run directory wrote its last event (the restart gap starts there).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

STARTUP_PHASES = ("process", "process_group", "data", "model", "checkpoint_load", "setup_other")


def process_start_time() -> float:
    """Wall time this process was created, so the interpreter's start and imports count (Linux:
    /proc, within a second: the boot time it counts from is whole seconds; elsewhere: now)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(
            int(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime ")
        )
        return min(time.time(), boot + ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


@dataclass
class StartupClock:
    """Seconds of each startup phase: `mark(phase)` ends the phase that ran since the last mark
    (the first one since the process started)."""

    started: float = field(default_factory=process_start_time)
    phases: dict[str, float] = field(default_factory=dict)
    last: float = field(default_factory=time.time)
    previous_end: float | None = None
    """Time of the last event an earlier process of this run directory wrote (None: a new run)."""

    def __post_init__(self) -> None:
        self.last = self.started

    def mark(self, phase: str) -> None:
        assert phase in STARTUP_PHASES, phase
        now = time.time()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self.last
        self.last = now

    def record(self, first_step_end: float) -> dict[str, Any]:
        """The `startup` event's details, once the first step has ended."""
        out = {f"{p}_s": round(self.phases.get(p, 0.0), 3) for p in STARTUP_PHASES}
        out["first_step_s"] = round(first_step_end - self.last, 3)
        out["total_s"] = round(first_step_end - self.started, 3)
        if self.previous_end is not None:
            out["restart_gap_s"] = round(max(0.0, self.started - self.previous_end), 3)
        launcher = {  # restart counts, and ranks per node (for bandwidths per node)
            k.lower(): int(os.environ[k])
            for k in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT", "LOCAL_WORLD_SIZE")
            if os.environ.get(k, "").isdigit()
        }
        return out | launcher


@dataclass
class Tally:
    count: int = 0
    seconds: float = 0.0
    bytes: int = 0

    def add(self, seconds: float, num_bytes: int = 0) -> None:
        self.count += 1
        self.seconds += seconds
        self.bytes += num_bytes

    def to_dict(self) -> dict[str, float]:
        mean = self.seconds / self.count if self.count else 0.0
        per = self.bytes // self.count if self.count else 0
        return {
            "count": self.count,
            "seconds": round(self.seconds, 4),
            "mean_s": round(mean, 5),
            "bytes_each": per,
        }


def nested_bytes(obj: Any) -> int:
    """Bytes of the tensors in nested dicts and lists (a host copy of a rank's state)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(nested_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(nested_bytes(v) for v in obj)
    return 0


def last_event_time(events: Path, chunk: int = 65536) -> float | None:
    """`time` of the last whole line of an events.jsonl, or None. Read from its end in growing
    windows: one event can be long (a checkpoint's bytes per rank at 16,384 ranks: ~180 KB)."""
    if not events.is_file():
        return None
    with open(events, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        window = chunk
        while True:
            start = max(0, size - window)
            f.seek(start)
            lines = f.read().decode(errors="replace").splitlines()
            if start > 0:
                lines = lines[1:]  # the first may be cut
            for line in reversed(lines):
                try:
                    return float(json.loads(line)["time"])
                except (ValueError, KeyError, TypeError):
                    continue
            if start == 0:
                return None
            window *= 4
