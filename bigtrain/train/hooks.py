"""The fixed set of hooks through which what observes a run plugs into the loop.

What changes the run when a step goes wrong (detect, replay, roll back, back off) is not a hook:
the loop calls bigtrain/resilience's Healer by name. Order of one run (loop.py):

    on_start(trainer)                      after setup and resume, before the first step
    healer.start                           the start target and its record
    per optimizer step:
        on_after_backward(trainer, r)      gradients of all micro-batches are in place, not yet
                                           clipped; `r` is the step's StepResult (train/step.py)
                                           with step, lr and this rank's local_loss
        healer.judge                       the verdict; one replay of an anomalous step
        healer.after_step                  the decision (`r.action`, `rolled_back`, ...)
        on_step_end(trainer, r)            after the optimizer step (or its skip) and the
                                           healer's decision; `r` holds the step's loss, grad
                                           norm, anomaly, action, ...
        healer.end_step                    a new rollback target's snapshot (it holds the
                                           callbacks' state of the step: INT8 calibration)
    on_event(trainer, record)              whenever an event is written (any time)
    on_finish(trainer)                     after the last step, before final.json
    on_stop(trainer, reason)               instead of on_finish when every rank gives up at the
                                           same step (an abort, exit 3; an excluded host, exit 6):
                                           finish what must not be lost

A callback with a `state_key` also has `state_dict()`/`load_state_dict()`: its state travels in the
trainer state (checkpoints and rollback targets) under that key.

Callbacks run in the order the run's assembly lists them, once, with the reason for each place
(bigtrain/build.py `make_callbacks`): a callback that writes what another reads comes first
(evaluation's `val_loss`, the straggler report's `step_time_by_rank`, the metrics logger's
`record` before the console and the metric sinks); the preemption handler, the hang watchdog and
the profiler come last.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bigtrain.train import Trainer
    from bigtrain.train.step import StepResult


class Callback:
    state_key: str | None = None
    """Set by a callback whose state travels in checkpoints and snapshots (state_dict below)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def on_start(self, trainer: Trainer) -> None: ...

    def on_before_forward(self, trainer: Trainer, step: int) -> None:
        """Before the step's first forward, and again before its replay's (trainer.replaying)."""

    def on_after_backward(self, trainer: Trainer, result: StepResult) -> None: ...

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None: ...

    def on_event(self, trainer: Trainer, record: dict[str, Any]) -> None: ...

    def on_finish(self, trainer: Trainer) -> None: ...

    def on_stop(self, trainer: Trainer, reason: str) -> None: ...

    def close(self) -> None:
        """Release resources; called on every exit path, also after an error."""


def close_each(items: list) -> None:
    """`close()` of every item, in order, each whatever the others raised; then the first error
    (if any) is raised."""
    errors = []
    for item in items:
        try:
            item.close()
        except Exception as e:  # noqa: BLE001 (re-raised below)
            errors.append(e)
    if errors:
        raise errors[0]


class Callbacks:
    """The run's callbacks, called hook by hook in the order given (build.py says why)."""

    def __init__(self, callbacks: list[Callback]) -> None:
        self.items = list(callbacks)

    def state_dict(self) -> dict[str, Any]:
        return {cb.state_key: cb.state_dict() for cb in self.items if cb.state_key is not None}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Restore the callbacks that saved state; a callback the saved run did not have (say,
        INT8 switched on at resume) starts fresh."""
        for cb in self.items:
            if cb.state_key is not None and cb.state_key in saved:
                cb.load_state_dict(saved[cb.state_key])

    def close(self) -> None:
        """Every callback's close, also after one of them raises: a failing sink must not leave
        the others unclosed."""
        close_each(self.items)

    def __getattr__(self, hook: str):
        if not (hook.startswith("on_") or hook == "close") or not hasattr(Callback, hook):
            raise AttributeError(f"{hook!r} is not a hook of Callback")

        def call(*args: Any) -> None:
            for cb in self.items:
                getattr(cb, hook)(*args)

        return call
