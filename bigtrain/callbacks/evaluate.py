"""Validation loss every `train.eval_every` steps, at the last step, and once before a fresh run."""

from __future__ import annotations

from bigtrain.train.hooks import Callback
from bigtrain.train.step import StepResult


class EvalCallback(Callback):
    def __init__(self, batches: list, every: int) -> None:
        self.batches, self.every = batches, every

    def due(self, trainer) -> bool:
        return self.every > 0 and (trainer.step % self.every == 0 or trainer.is_last_step())

    def on_start(self, trainer) -> None:
        if self.every > 0 and trainer.step == 0:
            # Expensive device-to-host synchronization: once, for the starting point of the curve.
            val_loss = trainer.backend.eval_loss(self.batches).item()
            trainer.record_start({"step": trainer.step, "val_loss": val_loss})

    def on_step_end(self, trainer, result: StepResult) -> None:
        if self.due(trainer):
            # each replica group evaluates its slice; their mean is the whole validation set's
            result.val_loss = trainer.replicas.average(trainer.backend.eval_loss(self.batches))
