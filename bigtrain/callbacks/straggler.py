"""Straggler reports: every `monitor.timing_every` steps the ranks share the parts of their step
time (one small all-gather; StepTimer in train/timing.py measures them); a rank whose data,
forward+backward, optimizer or other part takes `monitor.straggler_factor` times the median rank's
(and at least 10 ms more) gets a `straggler` event naming the rank and the part. `sync` is
reported, not judged: it is the symptom on the ranks that wait."""

from __future__ import annotations

import statistics

from bigtrain.telemetry.memory import peak_memory_bytes
from bigtrain.train.hooks import Callback
from bigtrain.train.step import StepResult
from bigtrain.train.timing import PARTS
from bigtrain.utils.dist import all_gather_objects

JUDGED = ("data", "forward_backward", "optimizer", "other")
MIN_EXCESS_S = 0.01  # a straggler's part exceeds the median by at least this much
PEAK = "peak_memory_bytes"


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
    """On timing steps: gathers every rank's parts into `result.step_time_by_rank` and its peak
    memory into `result.peak_memory_bytes_by_rank` (both logged), and writes `straggler`
    events."""

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def on_step_end(self, trainer, result: StepResult) -> None:
        timing = result.step_timing
        if timing is None:
            return
        # Each rank's peak memory travels in the same gather.
        by_rank = all_gather_objects({**timing, PEAK: peak_memory_bytes(trainer.device)})
        result.step_time_by_rank = {
            part: [round(times[part], 6) for times in by_rank] for part in PARTS
        }
        result.peak_memory_bytes_by_rank = [times[PEAK] for times in by_rank]
        for straggler in find_stragglers(by_rank, self.factor):
            trainer.event(
                "straggler",
                ratio=round(straggler["seconds"] / max(straggler["median_s"], 1e-9), 2),
                **straggler,
            )
