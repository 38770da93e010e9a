"""The callback registry: order, dispatch of every hook, callback state in checkpoints, and hook
names that do not exist."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
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

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

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
    def __init__(self, key: str | None) -> None:
        self.state_key = key
        self.count, self.loaded = 0, False

    def on_step_end(self, trainer, result: StepResult) -> None:
        self.count += 1

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count, self.loaded = state["count"], True


def test_callbacks_run_in_the_order_they_are_given():
    log: list = []
    order = ["faults", "eval", "checkpoint", "metrics", "console", "wandb", "preempt"]
    callbacks = Callbacks([Recorder(name, log) for name in order])
    assert [cb.name for cb in callbacks.items] == order
    trainer, result = object(), StepResult(4, 1e-3)
    callbacks.on_step_end(trainer, result)
    assert log == [(name, "on_step_end", (trainer, result)) for name in order]


def test_no_callback_carries_an_order_number():
    """The order is one list in the run's assembly (build.py make_callbacks), not numbers."""
    import bigtrain.callbacks as package

    names = [p.stem for p in Path(package.__file__).parent.glob("*.py") if p.stem != "__init__"]
    for name in names:
        module = importlib.import_module(f"bigtrain.callbacks.{name}")
        for cls in vars(module).values():
            if isinstance(cls, type) and issubclass(cls, Callback):
                assert "priority" not in vars(cls), f"{name}.{cls.__name__}"
    assert not hasattr(Callback, "priority")


@pytest.mark.parametrize("hook", sorted(HOOK_ARGS))
def test_every_hook_reaches_every_callback_with_its_arguments(hook):
    log: list = []
    callbacks = Callbacks([Recorder("a", log), Recorder("b", log)])
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
    saved_run = [Counter("int8"), Counter(None), Counter("straggler")]
    callbacks = Callbacks(saved_run)
    for _ in range(3):
        callbacks.on_step_end(object(), StepResult(1, 1e-3))
    state = callbacks.state_dict()
    assert state == {"int8": {"count": 3}, "straggler": {"count": 3}}  # no key: nothing saved
    resumed = [Counter("straggler"), Counter("int8"), Counter(None)]
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
