"""The run's one typed state (bigtrain/state/run.py): a checkpoint, a rejoining group's transfer
and a rollback snapshot hold the same parts, and a part registered once is in all three."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from bigtrain.build import build_trainer
from bigtrain.parallel.env import DistEnv
from bigtrain.state.run import Counters, RunState

pytestmark = pytest.mark.unit


class Tally:
    """A Stateful part a later feature might add: one number."""

    def __init__(self) -> None:
        self.value = 0

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]


def checkpoint_and_transfer(trainer) -> tuple[dict[str, Any], dict[str, Any]]:
    """What a checkpoint of the trainer's state loads back, and what a peer would send."""
    manager, setup = trainer.healer.manager, trainer.setup
    path = manager.save(
        trainer.step,
        trainer.backend,
        trainer.run.state_dict(),
        setup.identity,
        setup.config_yaml,
        shapes=setup.shapes,
    )
    return manager.load(path, trainer.backend), trainer.run.peer_state()


def test_a_checkpoint_a_transfer_and_a_snapshot_hold_the_same_parts(micro):
    overrides = ("train.max_steps=3", "train.eval_every=0", "checkpoint.every=0")
    trainer = build_trainer(micro(*overrides, out="a"), DistEnv())
    tally = Tally()
    trainer.run.add("tally", tally)  # added once: no other edit
    trainer.fit()
    tally.value = 7
    saved, transfer = checkpoint_and_transfer(trainer)
    assert set(saved) == set(transfer["parts"]) and len(saved) >= 8
    assert {"state", "data", "resilience", "local", "tally"} <= set(saved)
    assert saved["tally"] == transfer["parts"]["tally"] == {"value": 7}
    held = trainer.run.hold()  # a rollback snapshot: what a rollback restores
    assert set(held.parts) == set(saved) - {"resilience", "replicas"}
    assert held.parts["tally"] == {"value": 7}
    # A fresh run takes the transfer whole: the counters and the new part alike.
    fresh = build_trainer(micro(*overrides, out="b"), DistEnv())
    fresh_tally = Tally()
    fresh.run.add("tally", fresh_tally)
    fresh.run.load_peer_state(transfer)
    assert fresh_tally.value == 7 and fresh.state.step == trainer.state.step == 3
    assert fresh.backend.fingerprint() == trainer.backend.fingerprint()
    for t in (trainer, fresh):
        t.callbacks.close()


class Weights:
    """A backend's state as RunState uses it: one tensor."""

    def __init__(self) -> None:
        self.weight = torch.zeros(2)

    def local_state(self) -> dict[str, Any]:
        return {"w": self.weight.clone()}

    def load_local_state(self, state: dict[str, Any]) -> None:
        self.weight.copy_(state["w"])

    def extra_state(self) -> dict[str, Any]:
        return {}

    def load_extra_state(self, saved: dict[str, Any]) -> None:
        pass


class Cursor:
    def __init__(self) -> None:
        self.cursor = 0

    def state_dict(self) -> dict[str, Any]:
        return {"cursor": self.cursor}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cursor = state["cursor"]


def small_run() -> tuple[RunState, Weights, Cursor]:
    backend, cursor = Weights(), Cursor()
    return RunState(backend, Counters(), cursor, 4, 64), backend, cursor  # type: ignore[arg-type]


def test_a_rollback_restores_what_trains_and_keeps_the_bookkeeping():
    run, backend, cursor = small_run()
    bookkeeping, trained = Tally(), Tally()
    run.add("trained", trained)
    run.add("bookkeeping", bookkeeping, rollback=False)
    held = run.hold()
    counters = run.counters
    backend.weight += 1
    cursor.cursor, trained.value, bookkeeping.value, counters.step = 40, 3, 5, 10
    run.load_held(held)
    assert backend.weight.tolist() == [0.0, 0.0] and cursor.cursor == 0
    assert (trained.value, bookkeeping.value) == (0, 5)  # the healer's own stays
    assert run.counters is counters and counters.step == 0  # loaded in place


def test_a_part_missing_from_a_saved_state_loads_its_default_or_stays():
    run, _, _ = small_run()
    with_default, without = Tally(), Tally()
    run.add("with_default", with_default, missing={"value": 1})
    run.add("without", without)
    with_default.value = without.value = 9
    run.load_state_dict({"state": Counters(step=3).state_dict(), "data": {"cursor": 2}})
    assert (with_default.value, without.value, run.step) == (1, 9, 3)
    with pytest.raises(AssertionError, match="registered twice"):
        run.add("without", Tally())


def test_counters_load_in_place_and_default_what_an_earlier_state_lacks():
    counters = Counters(step=5, tokens_skipped_by_group={"1": 8})
    counters.load_state_dict({"step": 2, "rollbacks": 1})
    assert (counters.step, counters.rollbacks, counters.tokens_skipped_by_group) == (2, 1, {})
