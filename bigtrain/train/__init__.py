"""The training loop: Trainer and its state (loop.py), the hooks callbacks plug into (hooks.py),
the replay of an anomalous step (replay.py), the step's time by part (timing.py)."""

from bigtrain.train.loop import HostCopy, Trainer, TrainState, lr_at

__all__ = ["HostCopy", "TrainState", "Trainer", "lr_at"]
