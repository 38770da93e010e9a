"""The fault injector on a stub trainer: each switch fires at its steps only, on its rank only, once
per step number (again in the replay of the step where the docstrings say so), does what its
docstring says to the loss or the gradients, and writes a `fault` event."""

from __future__ import annotations

import math
import os
import signal
from types import SimpleNamespace

import pytest
import torch

from bigtrain.callbacks import drills as fault_injection
from bigtrain.callbacks.drills import Drills
from bigtrain.config.schema import DrillConfig
from bigtrain.errors import ConfigError
from tests.stubs import StubTrainer

pytestmark = pytest.mark.unit

QKV, HEAD = "blocks.0.attn.qkv.weight", "lm_head.weight"  # the stub's gradients: 2.0 and 3.0


def make(tmp_path, rank: int = 0, **switches) -> StubTrainer:
    return StubTrainer(tmp_path, [Drills(DrillConfig(**switches), rank)], rank=rank)


def grads(trainer: StubTrainer) -> dict[str, list[float]]:
    return {n: g.flatten().tolist() for n, g in trainer.backend.named_grads() if g.numel()}


CLEAN = {QKV: [2.0] * 6, HEAD: [3.0] * 4}


@pytest.mark.parametrize(
    ("switch", "value"),
    [("nan_grad_step", "nan"), ("inf_grad_step", "inf"), ("transient_nan_step", "nan")],
)
def test_a_nonfinite_gradient_drill_poisons_one_value_of_the_first_gradient_held(
    tmp_path, switch, value
):
    trainer = make(tmp_path, **{switch: [2]})
    trainer.after_backward()
    assert grads(trainer) == CLEAN
    trainer.state.step = 1
    result = trainer.after_backward()
    assert result.step == 2 and result.local_loss.item() == 2.0  # the loss is left alone
    poisoned = grads(trainer)
    # wte.weight comes first but this rank holds none of it: the first one held is poisoned.
    assert str(poisoned[QKV][0]) == value
    assert poisoned[QKV][1:] == CLEAN[QKV][1:] and poisoned[HEAD] == CLEAN[HEAD]
    (event,) = trainer.events()
    assert (event["kind"], event["type"], event["tensor"], event["step"]) == (
        "fault",
        switch.removesuffix("_step"),
        QKV,
        2,
    )
    trainer.backend.grads[QKV].fill_(2.0)
    trainer.state.step = 2
    trainer.after_backward()
    assert grads(trainer) == CLEAN and len(trainer.events()) == 1


def test_a_gradient_spike_multiplies_the_chosen_tensor_only(tmp_path):
    trainer = make(tmp_path, grad_spike_step=[1], spike_factor=10.0, grad_tensor=HEAD)
    trainer.after_backward()
    assert grads(trainer) == {QKV: CLEAN[QKV], HEAD: [30.0] * 4}
    assert trainer.events()[0]["tensor"] == HEAD


def test_a_spike_multiplies_the_loss_and_every_gradient(tmp_path):
    trainer = make(tmp_path, spike_step=[1], spike_factor=10.0)
    assert trainer.after_backward(local_loss=2.5).local_loss.item() == 25.0
    assert grads(trainer) == {QKV: [20.0] * 6, HEAD: [30.0] * 4}
    (event,) = trainer.events()
    assert (event["type"], event["factor"]) == ("spike", 10.0)


def test_a_loss_spike_leaves_the_gradients_intact(tmp_path):
    trainer = make(tmp_path, loss_spike_step=[1], spike_factor=10.0)
    assert trainer.after_backward(local_loss=2.5).local_loss.item() == 25.0
    assert grads(trainer) == CLEAN
    (event,) = trainer.events()
    assert (event["type"], event["factor"]) == ("loss_spike", 10.0)


def test_a_nan_loss_poisons_the_loss_and_every_gradient(tmp_path):
    trainer = make(tmp_path, nan_loss_step=[1])
    assert math.isnan(trainer.after_backward().local_loss.item())
    assert all(math.isnan(v) for values in grads(trainer).values() for v in values)
    assert trainer.events()[0]["type"] == "nan_loss"


def test_faults_fire_on_their_rank_only(tmp_path):
    trainer = make(tmp_path, rank=1, nan_grad_step=[1], spike_step=[1], sigterm_step=[1])
    trainer.after_backward()
    trainer.step_end()
    assert grads(trainer) == CLEAN and not trainer.events()


def test_a_step_number_fires_once_even_when_a_rollback_repeats_it(tmp_path):
    trainer = make(tmp_path, nan_grad_step=[1, 3])
    trainer.after_backward()
    trainer.backend.grads[QKV].fill_(2.0)
    trainer.after_backward()  # step 1 again, after a rollback to step 0
    assert grads(trainer) == CLEAN
    trainer.state.step = 2
    trainer.after_backward()
    assert [e["step"] for e in trainer.events()] == [1, 3]


def test_a_replay_meets_the_data_faults_again_but_not_a_transient_one(tmp_path):
    trainer = make(tmp_path, nan_grad_step=[1], transient_nan_step=[1], grad_tensor=HEAD)
    trainer.after_backward()
    assert [e["type"] for e in trainer.events()] == ["nan_grad", "transient_nan"]
    trainer.backend.grads[HEAD].fill_(3.0)  # the replay's backward
    trainer.replaying = True
    trainer.after_backward()
    assert [e["type"] for e in trainer.events()] == ["nan_grad", "transient_nan", "nan_grad"]
    assert math.isnan(grads(trainer)[HEAD][0])
    trainer.replaying = False
    trainer.backend.grads[HEAD].fill_(3.0)
    trainer.state.step = 1
    trainer.after_backward()  # step 2, first run: nothing scheduled, nothing left from step 1
    trainer.replaying = True
    trainer.after_backward()
    assert len(trainer.events()) == 3 and grads(trainer) == CLEAN


def test_silent_corruption_drills_fire_on_the_first_run_only_a_data_spike_again(tmp_path):
    """grad_spike and bitflip are silent data corruption: the replay comes out clean; the same
    spike from the data (data_spike) is met again."""
    for switch, replayed in (("grad_spike_step", CLEAN[HEAD]), ("data_spike_step", [30.0] * 4)):
        trainer = make(tmp_path, **{switch: [1]}, spike_factor=10.0, grad_tensor=HEAD)
        trainer.after_backward()
        assert grads(trainer)[HEAD] == [30.0] * 4
        trainer.backend.grads[HEAD].fill_(3.0)  # the replay's backward
        trainer.replaying = True
        trainer.after_backward()
        assert grads(trainer)[HEAD] == replayed, switch
    trainer = make(tmp_path, bitflip_step=[1], bitflip_index=2, grad_tensor=HEAD)
    trainer.after_backward()
    flipped = grads(trainer)[HEAD]
    # 3.0 = 1.5 x 2^1 (exponent field 128): the highest exponent bit is set, so the flip takes
    # the field to 0, a subnormal 0.5 x 2^-126; a value below 2 would go up by 2^128
    assert flipped[:2] == [3.0, 3.0] and flipped[3:] == [3.0] and flipped[2] == 2.0**-127
    (event,) = trainer.events()
    assert (event["type"], event["index"], event["before"]) == ("bitflip", 2, 3.0)
    trainer.backend.grads[HEAD].fill_(3.0)
    trainer.replaying = True
    trainer.after_backward()
    assert grads(trainer)[HEAD] == CLEAN[HEAD] and len(trainer.events()) == 1


@pytest.mark.parametrize(
    ("dtype", "bit", "expected"),
    [
        (torch.float32, -1, 0.5 * 2.0**128),  # exponent 126 -> 254
        (torch.float32, 23, 1.0),  # the lowest exponent bit: 0.5 -> 1.0
        (torch.float32, 31, -0.5),  # the sign
        (torch.bfloat16, -1, 0.5 * 2.0**128),  # bit 14
        (torch.float16, -1, 32768.0),  # bit 14: exponent field 14 -> 30, 2^-1 -> 2^15
    ],
)
def test_flip_bit_flips_the_chosen_bit_of_the_dtype(dtype, bit, expected):
    t = torch.full((3,), 0.5, dtype=dtype)
    before, after = fault_injection.flip_bit(t, 1, bit)
    assert before == 0.5 and after == expected and t[1].item() == expected
    assert t[0].item() == t[2].item() == 0.5


def test_an_unknown_grad_tensor_is_a_config_error_naming_a_real_one(tmp_path):
    trainer = make(tmp_path, nan_grad_step=[1], grad_tensor="blocks.0.attn.qkv")
    with pytest.raises(ConfigError, match=r"'drill\.grad_tensor'.*such as 'wte\.weight'"):
        trainer.after_backward()


def test_a_grad_tensor_this_rank_holds_none_of_is_a_config_error(tmp_path):
    trainer = make(tmp_path, nan_grad_step=[1], grad_tensor="wte.weight")
    with pytest.raises(ConfigError, match="rank 0 holds no part of 'wte.weight'"):
        trainer.after_backward()


@pytest.fixture
def sent(monkeypatch) -> list[tuple[int, int]]:
    """Signals the injector sends (to itself), recorded instead of delivered."""
    calls: list[tuple[int, int]] = []
    fake = SimpleNamespace(getpid=os.getpid, kill=lambda pid, sig: calls.append((pid, sig)))
    monkeypatch.setattr(fault_injection, "os", fake)
    return calls


def test_sigterm_is_sent_after_its_step_once(tmp_path, sent):
    trainer = make(tmp_path, sigterm_step=[2])
    trainer.step_end()
    assert sent == []
    trainer.step_end()
    assert sent == [(os.getpid(), signal.SIGTERM)]
    trainer.state.step = 1
    trainer.step_end()  # step 2 again (a rollback)
    assert sent == [(os.getpid(), signal.SIGTERM)]
    assert [(e["type"], e["step"]) for e in trainer.events()] == [("sigterm", 2)]


def test_kill_fires_once_per_run_directory_so_the_restarted_run_goes_on(tmp_path, sent):
    first = make(tmp_path, kill_step=[2])
    first.healthy(2)
    assert sent == [(os.getpid(), signal.SIGKILL)]
    assert (tmp_path / ".fault-killed-step-2").is_file()
    assert [(e["type"], e["step"]) for e in first.events()] == [("kill", 2)]
    restarted = make(tmp_path, kill_step=[2])  # a new process, the same run directory
    restarted.state.step = 1
    restarted.step_end()
    assert len(sent) == 1 and not restarted.events()


def test_hang_waits_forever_once_per_run_directory(tmp_path, monkeypatch):
    waits = []
    event = SimpleNamespace(wait=lambda: waits.append("forever"))
    monkeypatch.setattr(fault_injection, "threading", SimpleNamespace(Event=lambda: event))
    trainer = make(tmp_path, hang_step=[1])
    trainer.after_backward()
    assert waits == ["forever"] and trainer.events()[0]["type"] == "hang"
    make(tmp_path, hang_step=[1]).after_backward()  # the restarted run
    assert waits == ["forever"]


@pytest.mark.parametrize(("rank", "sleeps"), [(1, [0.25]), (0, [])])
def test_the_slow_rank_sleeps_in_every_step_whatever_fault_rank_says(
    tmp_path, monkeypatch, rank, sleeps
):
    slept = []
    monkeypatch.setattr(fault_injection, "time", SimpleNamespace(sleep=slept.append))
    trainer = make(tmp_path, rank=rank, slow_rank=1, slow_s=0.25)  # drill.rank stays 0
    trainer.after_backward()
    assert slept == sleeps
    trainer.after_backward()
    assert slept == sleeps * 2
