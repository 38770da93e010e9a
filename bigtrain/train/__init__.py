"""The training loop: Trainer (loop.py), the hooks callbacks plug into (hooks.py), the step's result
(step.py), the step's time by part (timing.py). The run's state that the loop trains is
bigtrain/state; what changes a run when a step goes wrong is bigtrain/resilience, which the loop
calls by name."""

from bigtrain.train.loop import Trainer, lr_at

__all__ = ["Trainer", "lr_at"]
