"""Where a step's time goes, on every rank, and which rank holds the others back.

The loop marks the parts of a step (StepTimer): `data` (the next batches), `forward_backward`
(including the after-backward hooks), `sync` (the monitor's pass and all-reduce: where fast ranks
wait for slow ones), `optimizer` (clip and step) and `other` (the previous step's callbacks:
evaluation, checkpoints, logging). On CUDA the marks are events, read after one synchronize on
timing steps only; elsewhere the host clock. Every `monitor.timing_every` steps the ranks share
their parts (one small all-gather); a rank whose data, forward+backward, optimizer or other part
takes `monitor.straggler_factor` times the median rank's (and at least 10 ms more) gets a
`straggler` event naming the rank and the part. `sync` is reported, not judged: it is the
symptom on the ranks that wait.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from bigtrain.hooks import Callback
from bigtrain.parallel.env import all_gather_objects

PARTS = ("data", "forward_backward", "sync", "optimizer", "other")
JUDGED = ("data", "forward_backward", "optimizer", "other")
MIN_EXCESS_S = 0.01  # a straggler's part exceeds the median by at least this much


class StepTimer:
    def __init__(self, device: torch.device, every: int) -> None:
        self.cuda, self.every = device.type == "cuda", every
        self.active = False
        self.marks: list[tuple[str, Any]] = []
        self.last_end: float | None = None  # host time the previous step's train_step ended
        self.other_s = 0.0

    def _now(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self, step: int) -> None:
        now = time.perf_counter()
        self.other_s = now - self.last_end if self.last_end is not None else 0.0
        self.active = self.every > 0 and step % self.every == 0
        self.marks = [("start", self._now())] if self.active else []

    def mark(self, part: str) -> None:
        """End of `part` (a replay's second run adds to the same parts)."""
        if self.active:
            self.marks.append((part, self._now()))

    def finish(self) -> dict[str, float] | None:
        """Seconds per part of this step on timing steps, else None."""
        self.last_end = time.perf_counter()
        if not self.active:
            return None
        if self.cuda:
            torch.cuda.synchronize()  # host sync on timing steps only: the events are complete
        parts = dict.fromkeys(PARTS, 0.0)
        for (_, before), (part, after) in zip(self.marks, self.marks[1:], strict=False):
            parts[part] += before.elapsed_time(after) / 1e3 if self.cuda else after - before
        parts["other"] = self.other_s
        self.last_end = time.perf_counter()
        return parts


def find_stragglers(
    by_rank: list[dict[str, float]], factor: float
) -> list[dict[str, float | int | str]]:
    """Ranks whose judged part is `factor` x the median rank's and MIN_EXCESS_S above it."""
    found = []
    for part in JUDGED:
        values = [times[part] for times in by_rank]
        median = statistics.median(values)
        for rank, value in enumerate(values):
            if value > factor * median and value - median >= MIN_EXCESS_S:
                found.append({"rank": rank, "part": part, "seconds": value, "median_s": median})
    return found


class StragglerReport(Callback):
    """On timing steps: gathers every rank's parts into `metrics["step_time_by_rank"]` (logged)
    and writes `straggler` events."""

    priority = 70  # before metrics (80), so the per-rank times land in the step's record

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def on_step_end(self, trainer, metrics: dict[str, Any]) -> None:
        timing = metrics.get("step_timing")
        if timing is None:
            return
        by_rank = all_gather_objects(timing)
        metrics["step_time_by_rank"] = {
            part: [round(times[part], 6) for times in by_rank] for part in PARTS
        }
        for straggler in find_stragglers(by_rank, self.factor):
            trainer.event(
                "straggler",
                ratio=round(straggler["seconds"] / max(straggler["median_s"], 1e-9), 2),
                **straggler,
            )
