"""Preemption: SIGTERM or SIGUSR1 -> every rank checkpoints at the same step boundary -> exit 4.

The handler only asks the trainer to stop (`Trainer.request_stop`). The request rides in the monitor's SUM
all-reduce of the next step (`Trainer.stop_signal` -> `Health.stop_requested`), so every rank learns of it in the same
step even when the signal reached one rank only; the checkpoint callback then writes a synchronous
checkpoint and this callback ends the run with exit 4 (requeue me). Under SLURM deliver the signal
to the tasks (`--signal=B:USR1@120` reaches the batch shell only; use `--signal=USR1@120` with srun
tasks); torchrun's agent forwards SIGTERM but not SIGUSR1. A second signal ends the process at
once (the default action), e.g. when torchrun's agent stops the survivors of a crashed rank.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

from bigtrain.errors import Preempted
from bigtrain.train.hooks import Callback
from bigtrain.train.step import StepResult

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionHandler(Callback):
    def __init__(self) -> None:
        self.previous: dict[int, Any] = {}

    def on_start(self, trainer) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be installed from the main thread

        def handler(signum, frame) -> None:
            if trainer.stop_signal is not None:  # a second signal: stop now, the default way
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
            trainer.request_stop(signal.Signals(signum).name)

        for sig in SIGNALS:
            self.previous[sig] = signal.signal(sig, handler)

    def on_step_end(self, trainer, result: StepResult) -> None:
        if not result.preempt:
            return
        reason = f"{trainer.stop_signal or 'a signal on another rank'} at step {trainer.step}"
        trainer.event("preempt", reason=reason, checkpoint_step=trainer.step)
        raise Preempted(f"preempted: {reason}; checkpointed at step {trainer.step}, exit 4")

    def close(self) -> None:
        for sig, previous in self.previous.items():
            signal.signal(sig, previous)
        self.previous.clear()
