"""Where a step's time goes, on every rank, and which rank holds the others back.

The loop marks the parts of a step (StepTimer): `data` (the next batches), `forward_backward`
(including the after-backward hooks), `sync` (the monitor's pass and all-reduce: where fast ranks
wait for slow ones), `optimizer` (clip and step) and `other` (the previous step's callbacks:
evaluation, checkpoints, logging). On CUDA the marks are events, read after one synchronize on
timing steps only; elsewhere the host clock. callbacks/straggler.py compares the ranks' parts.
"""

from __future__ import annotations

import time
from typing import Any

import torch

PARTS = ("data", "forward_backward", "sync", "optimizer", "other")


class StepTimer:
    def __init__(self, device: torch.device, every: int) -> None:
        self.cuda, self.every = device.type == "cuda", every
        self.active = False
        self.marks: list[tuple[str, Any]] = []
        self.last_end: float | None = None  # host time the previous step's train_step ended
        self.other_s = 0.0
        self.extra = False  # time the next step too (confirm)

    def _now(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self, step: int) -> None:
        now = time.perf_counter()
        self.other_s = now - self.last_end if self.last_end is not None else 0.0
        self.active = self.every > 0 and (step % self.every == 0 or self.extra)
        self.extra = False
        self.marks = [("start", self._now())] if self.active else []

    def confirm(self) -> None:
        """Time the next step as well: a straggler found on a timing step is confirmed (or not)
        one step later instead of `every` steps later. Every rank must ask alike (the straggler
        report decides from numbers every rank of the group holds)."""
        self.extra = True

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
