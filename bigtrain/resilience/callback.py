"""Checkpoint every `checkpoint.every` steps and at the last step, through the atomic commit."""

from __future__ import annotations

import time
from typing import Any

from bigtrain.hooks import Callback
from bigtrain.resilience.checkpoint import CheckpointManager


class CheckpointCallback(Callback):
    priority = 50

    def __init__(self, manager: CheckpointManager, every: int) -> None:
        self.manager, self.every = manager, every

    def on_step_end(self, trainer, metrics: dict[str, Any]) -> None:
        step = trainer.step
        if trainer.is_last_step() or (self.every > 0 and step % self.every == 0):
            started = time.perf_counter()
            path = self.manager.save(
                step,
                trainer.backend,
                trainer.trainer_state(),
                trainer.context["identity"],
                trainer.context["config_yaml"],
            )
            trainer.event(
                "checkpoint", path=str(path), seconds=round(time.perf_counter() - started, 3)
            )
