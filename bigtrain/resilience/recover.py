"""Putting a rollback target's state back: from host memory, from its checkpoint, or rebuilt.

A target this process holds (its snapshot) is restored from memory. One it does not hold (its
snapshot went with a restart, or snapshots are off) is read from its committed checkpoint. One that
is neither is rebuilt: the newest state before it that this process can load (a held target, any
committed checkpoint, or the run's start rebuilt from the config) is restored, and the loop trains
forward to the target again; the same steps on the same data from the same state give the same
state (bit for bit on CPU). The run's start is rebuilt from its initial weights (`model.init_from`'s
source, or the seeded initial values) and the trainer state and RNG recorded at step 0.

Only the state of the training restores (weights, optimizer, counters, data cursor, detector
windows, RNG); the healer's own bookkeeping (targets, the ladder) stays as it is.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bigtrain.checkpoint.manager import CheckpointManager
from bigtrain.checkpoint.manifest import PREFIX, CheckpointError
from bigtrain.checkpoint.rng import rng_from_json, rng_state, rng_to_json, set_rng_state
from bigtrain.resilience.targets import Target
from bigtrain.state.run import LOCAL, RunState


def origin_record(run: RunState) -> dict[str, Any]:
    """What rebuilding the start needs besides its weights: the run's state a rollback restores
    and the RNG, at step 0 (JSON: it travels in checkpoints)."""
    state = run.state_dict(rollback_only=True)
    state.pop(LOCAL, None)  # a rank's own state, empty at the start: a rebuild starts it empty
    return {"trainer_state": state, "rng": rng_to_json(rng_state())}


class Recovery:
    """Loads targets for the healer: `restore(target)` -> (source, restored step)."""

    def __init__(
        self, manager: CheckpointManager, start_weights: Callable[[], None] | None
    ) -> None:
        self.manager = manager
        self.start_weights = start_weights
        """Loads the run's initial weights into the backend with a fresh optimizer (None: they
        cannot be rebuilt, as for a transformers model's own init)."""

    def newest(self, before: int | None = None, at: int | None = None) -> tuple[int, Path] | None:
        """The newest committed checkpoint (step, path) that verifies: at step `at`, or before
        step `before`. A bad one is skipped and older ones are tried."""
        for path in reversed(self.manager.committed()):
            step = int(path.name[len(PREFIX) :])
            if (at is not None and step != at) or (before is not None and step >= before):
                continue
            try:
                self.manager.verify(path)
            except CheckpointError:
                continue
            return step, path
        return None

    def restore(
        self, run: RunState, target: Target, older: list[Target], origin: dict[str, Any] | None
    ) -> tuple[str, int] | None:
        """Load `target`, or the newest loadable state before it (the caller trains forward);
        `older`: the targets before it, newest first. (source, step), or None: nothing loads."""
        if target.held is not None:
            run.load_held(target.held)
            return "memory", target.step
        at = self.newest(at=target.step) if target.step > 0 else None
        if at is not None:
            self._load_checkpoint(run, at[1])
            return "checkpoint", target.step
        if target.step == 0 and self._rebuild_start(run, origin):
            return "start", 0
        held = next((t for t in older if t.held is not None), None)
        disk = self.newest(before=target.step)
        if held is not None and (disk is None or held.step >= disk[0]):
            run.load_held(held.held)
            return "replay from memory", held.step
        if disk is not None:
            self._load_checkpoint(run, disk[1])
            return "replay from checkpoint", disk[0]
        if self._rebuild_start(run, origin):
            return "replay from start", 0
        return None

    def _load_checkpoint(self, run: RunState, path: Path) -> None:
        run.load_state_dict(self.manager.load(path, run.backend), rollback_only=True)

    def _rebuild_start(self, run: RunState, origin: dict[str, Any] | None) -> bool:
        if origin is None or self.start_weights is None:
            return False
        self.start_weights()
        run.load_state_dict(copy.deepcopy(origin["trainer_state"]), rollback_only=True)
        set_rng_state(rng_from_json(origin["rng"]))
        return True
