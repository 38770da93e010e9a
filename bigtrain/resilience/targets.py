"""Rollback targets: the states a rollback may return to, the same whether or not the run restarted.

The targets are the run's start (step 0, good by definition) and its *cadence steps*: every
`resilience.snapshot_every`-th and every `checkpoint.every`-th step that was applied and healthy,
the newest `resilience.snapshots` of them. A cadence target is good once `confirm_steps` healthy
steps followed it; an anomaly before that poisons it for good. Which targets exist and which are
good depends only on the run's history of steps, so it travels in checkpoints (`state_dict`): a
run stopped and resumed has the same targets, with the same counts, as one that never stopped.
A preemption's checkpoint at another step is where a run resumes, not a target.

Where a target's state comes from may differ (resilience/recover.py): held in host memory (the
snapshot taken at its step, when snapshots are on), read from its committed checkpoint, or rebuilt
by training forward again from an earlier state this process can load.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from bigtrain.state.run import Held

POISONED = -(10**9)  # healthy_after of a target that saw an anomaly before it was confirmed


@dataclass
class Target:
    step: int
    cursor: int
    """The data stream's cursor at the target: a rollback's skip window starts there."""
    healthy_after: int = 0
    held: Held | None = None

    def good(self, confirm_steps: int) -> bool:
        return self.healthy_after >= confirm_steps


class Targets:
    def __init__(self, snapshot_every: int, checkpoint_every: int, keep: int, confirm: int) -> None:
        self.snapshot_every, self.checkpoint_every = snapshot_every, checkpoint_every
        self.confirm = confirm
        self.start = Target(0, 0, healthy_after=confirm)  # good by definition
        self.ring: deque[Target] = deque(maxlen=max(keep, 1))

    def is_cadence(self, step: int) -> bool:
        cadences = (self.snapshot_every, self.checkpoint_every)
        return any(every > 0 and step % every == 0 for every in cadences)

    @property
    def holds_snapshots(self) -> bool:
        return self.snapshot_every > 0

    def add(self, target: Target) -> None:
        if self.ring and self.ring[-1].step >= target.step:  # the same step again (a replay)
            assert self.ring[-1].step == target.step, "targets are added in step order"
            self.ring[-1].held = target.held
            return
        self.ring.append(target)

    def healthy_step(self) -> None:
        for target in self.ring:
            target.healthy_after += 1

    def anomaly(self) -> None:
        """An anomaly: every target not yet confirmed is never good."""
        for target in self.ring:
            if not target.good(self.confirm):
                target.healthy_after = POISONED

    def at(self, step: int) -> Target | None:
        if step == self.start.step:
            return self.start
        return next((t for t in self.ring if t.step == step), None)

    def choose(self, bound: int) -> Target | None:
        """The newest good target before step `bound` (the start included)."""
        good = [self.start] + [t for t in self.ring if t.good(self.confirm)]
        return next((t for t in reversed(good) if t.step < bound), None)

    def before(self, step: int) -> list[Target]:
        """Every target before `step`, newest first (the start last): where a rebuild may
        start from."""
        older = [t for t in reversed(self.ring) if t.step < step]
        return older + ([self.start] if self.start.step < step else [])

    def drop_after(self, step: int) -> None:
        """Targets after `step` belong to an abandoned future."""
        while self.ring and self.ring[-1].step > step:
            self.ring.pop()

    def state_dict(self) -> dict[str, Any]:
        return {"ring": [[t.step, t.cursor, t.healthy_after] for t in self.ring]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Metadata only: what a process holds in memory stays its own."""
        self.ring.clear()
        for step, cursor, healthy_after in state["ring"]:
            self.ring.append(Target(int(step), int(cursor), int(healthy_after)))


class HeldTargets:
    """The snapshots the targets hold in host memory, as a rejoining replica group receives them
    (RunState.add_memory): a later rollback must restore the same state in every group, from the
    same source. By step; a target this group does not hold stays without one."""

    def __init__(self, targets: Targets) -> None:
        self.targets = targets

    def _all(self) -> list[Target]:
        return [self.targets.start, *self.targets.ring]

    def state_dict(self) -> dict[str, Any]:
        return {t.step: t.held for t in self._all() if t.held is not None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for target in self._all():
            target.held = state.get(target.step)
