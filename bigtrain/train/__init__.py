"""The training loop: Trainer and its state (loop.py), the hooks callbacks plug into (hooks.py),
the step's result (step.py), the step's time by part (timing.py). What changes a run when a step
goes wrong is bigtrain/resilience, which the loop calls by name."""

from bigtrain.train.loop import Trainer, TrainState, lr_at

__all__ = ["TrainState", "Trainer", "lr_at"]
