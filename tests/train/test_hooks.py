"""The callback registry: order, dispatch of every hook, callback state in checkpoints, and hook
names that do not exist."""

from __future__ import annotations

import json
from typing import Any

import pytest

from bigtrain.train.hooks import Callback, Callbacks
from bigtrain.train.step import StepResult

pytestmark = pytest.mark.unit

HOOK_ARGS = {
    "on_start": lambda t, r: (t,),
    "on_after_backward": lambda t, r: (t, r),
    "on_step_end": lambda t, r: (t, r),
    "on_event": lambda t, r: (t, {"kind": "checkpoint", "step": 3}),
    "on_finish": lambda t, r: (t,),
    "on_stop": lambda t, r: (t, "abort"),
    "close": lambda t, r: (),
}


class Recorder(Callback):
    """Writes (its name, the hook, the arguments) to a shared log on every hook."""

    def __init__(self, name: str, priority: int, log: list) -> None:
        self.name, self.priority, self.log = name, priority, log

    def _record(self, hook: str, *args: Any) -> None:
        self.log.append((self.name, hook, args))

    def on_start(self, *args: Any) -> None:
        self._record("on_start", *args)

    def on_after_backward(self, *args: Any) -> None:
        self._record("on_after_backward", *args)

    def on_step_end(self, *args: Any) -> None:
        self._record("on_step_end", *args)

    def on_event(self, *args: Any) -> None:
        self._record("on_event", *args)

    def on_finish(self, *args: Any) -> None:
        self._record("on_finish", *args)

    def on_stop(self, *args: Any) -> None:
        self._record("on_stop", *args)

    def close(self, *args: Any) -> None:
        self._record("close", *args)


class Counter(Callback):
    def __init__(self, key: str | None, priority: int = 50) -> None:
        self.state_key, self.priority = key, priority
        self.count, self.loaded = 0, False

    def on_step_end(self, trainer, result: StepResult) -> None:
        self.count += 1

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count, self.loaded = state["count"], True


def test_callbacks_run_in_ascending_priority_ties_in_registration_order():
    log: list = []
    priorities = {"metrics": 80, "guard": 1, "eval": 10, "checkpoint": 50, "faults": 0}
    priorities |= {"ckpt2": 50, "preempt": 95, "rollback": 2, "console": 90, "wandb": 90}
    callbacks = Callbacks([Recorder(name, p, log) for name, p in priorities.items()])
    order = ["faults", "guard", "rollback", "eval", "checkpoint", "ckpt2", "metrics"]
    order += ["console", "wandb", "preempt"]
    assert [cb.name for cb in callbacks.items] == order
    trainer, result = object(), StepResult(4, 1e-3)
    callbacks.on_step_end(trainer, result)
    assert log == [(name, "on_step_end", (trainer, result)) for name in order]


@pytest.mark.parametrize("hook", sorted(HOOK_ARGS))
def test_every_hook_reaches_every_callback_with_its_arguments(hook):
    log: list = []
    callbacks = Callbacks([Recorder("b", 5, log), Recorder("a", 1, log)])
    args = HOOK_ARGS[hook](object(), StepResult(1, 1e-3))
    getattr(callbacks, hook)(*args)
    assert log == [("a", hook, args), ("b", hook, args)]


def test_a_callback_needs_to_define_only_the_hooks_it_uses():
    counter = Counter(None)
    callbacks = Callbacks([counter])
    trainer, result = object(), StepResult(1, 1e-3)
    for hook, args in HOOK_ARGS.items():
        getattr(callbacks, hook)(*args(trainer, result))
    assert counter.count == 1


def test_callback_state_round_trips_under_its_key():
    saved_run = [Counter("int8"), Counter(None), Counter("straggler", priority=70)]
    callbacks = Callbacks(saved_run)
    for _ in range(3):
        callbacks.on_step_end(object(), StepResult(1, 1e-3))
    state = callbacks.state_dict()
    assert state == {"int8": {"count": 3}, "straggler": {"count": 3}}  # no key: nothing saved
    resumed = [Counter("straggler", priority=70), Counter("int8"), Counter(None)]
    Callbacks(resumed).load_state_dict(json.loads(json.dumps(state)))  # as trainer.json holds it
    assert [(c.state_key, c.count, c.loaded) for c in resumed] == [
        ("straggler", 3, True),
        ("int8", 3, True),
        (None, 0, False),
    ]


def test_a_callback_the_saved_run_did_not_have_starts_fresh():
    added = Counter("int8")  # switched on at resume
    kept = Counter("straggler")
    Callbacks([added, kept]).load_state_dict({"straggler": {"count": 7}, "gone": {"count": 1}})
    assert (added.count, added.loaded) == (0, False)
    assert (kept.count, kept.loaded) == (7, True)


def test_a_name_that_is_no_hook_raises_attribute_error():
    callbacks = Callbacks([Counter(None)])
    with pytest.raises(AttributeError, match="step_end"):
        callbacks.step_end  # noqa: B018
    with pytest.raises(AttributeError, match="on_step_ends"):
        callbacks.on_step_ends(object(), StepResult(1, 1e-3))  # a misspelt hook


def test_a_misspelt_hook_fails_where_it_is_named():
    with pytest.raises(AttributeError):
        Callbacks([]).on_step_ends  # noqa: B018


def test_close_reaches_every_callback_when_one_raises_and_raises_the_first_error():
    closed = []

    class Closing(Callback):
        def __init__(self, name: str, fails: bool) -> None:
            self.name, self.fails = name, fails

        def close(self) -> None:
            closed.append(self.name)
            if self.fails:
                raise OSError(f"{self.name} cannot close")

    callbacks = Callbacks([Closing("a", True), Closing("b", False), Closing("c", True)])
    with pytest.raises(OSError, match="a cannot close"):
        callbacks.close()
    assert closed == ["a", "b", "c"]
