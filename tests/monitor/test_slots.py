"""The monitor's named slots (monitor/slots.py): packed into one flat tensor per reduction kind,
read back by name, whatever else a step carries."""

from __future__ import annotations

import pytest
import torch

from bigtrain.monitor.slots import Slot, SlotLayout

pytestmark = pytest.mark.unit

SLOTS = [
    Slot("sum_sq", 3, "sum"),
    Slot("max_abs", 3, "max"),
    Slot("loss", 1, "sum"),
    Slot("shards", 2, "max"),
]


def values(rank: int, slots: list[Slot] = SLOTS) -> dict[str, torch.Tensor]:
    """One rank's tensors for `slots`."""
    every = {
        "sum_sq": torch.tensor([1.0, 2.0, 3.0]) * (rank + 1),
        "max_abs": torch.tensor([0.5, 4.0, 1.0]) + rank,
        "loss": torch.tensor(2.5 + rank),  # a scalar: flattened to one value
        "shards": torch.tensor([-1.0, 7.0 * rank]),
        "stop": torch.tensor([float(rank)]),
    }
    return {s.name: every[s.name] for s in slots}


class TwoRanks:
    """An all-reduce with a second rank's pack: SUM adds its flat tensor, MAX takes the larger."""

    def __init__(self, other) -> None:
        self.other, self.calls = other, []

    def __call__(self, flat: torch.Tensor, kind: str) -> None:
        self.calls.append((kind, flat.numel()))
        theirs = self.other.flat(kind)
        flat.add_(theirs) if kind == "sum" else torch.maximum(flat, theirs, out=flat)


def reduced(slots: list[Slot]):
    layout = SlotLayout(slots)
    mine, theirs = layout.fill(values(0, slots)), layout.fill(values(1, slots))
    reduction = TwoRanks(theirs)
    return mine.reduce(reduction).read(), reduction.calls


def test_a_new_slot_leaves_every_other_value_read_back_unchanged():
    before, _ = reduced(SLOTS)
    # the stop flag declared first: it shifts every sum slot's position in the flat tensor
    after, calls = reduced([Slot("stop", 1, "sum"), *SLOTS])
    assert after["stop"] == [1.0]
    for slot in SLOTS:
        assert after[slot.name] == before[slot.name], slot.name
    assert before["sum_sq"] == [3.0, 6.0, 9.0] and before["loss"] == [6.0]
    assert before["max_abs"] == [1.5, 5.0, 2.0] and before["shards"] == [-1.0, 7.0]
    assert calls == [("sum", 5), ("max", 5)]  # one reduction per kind, the new slot inside


def test_sum_and_max_slots_pack_into_one_flat_tensor_each_in_declared_order():
    pack = SlotLayout(SLOTS).fill(values(0))
    assert pack.flat("sum").tolist() == [1.0, 2.0, 3.0, 2.5]
    assert pack.flat("max").tolist() == [0.5, 4.0, 1.0, -1.0, 0.0]
    only_sums = [Slot("sum_sq", 3, "sum"), Slot("loss", 1, "sum")]
    pack = SlotLayout(only_sums).fill(values(0, only_sums))
    assert pack.flat("max") is None  # a step without max slots: no MAX collective
    calls = []
    out = pack.reduce(lambda flat, kind: calls.append(kind))
    assert calls == ["sum"] and out["loss"].tolist() == [2.5]


def test_reduced_values_are_views_of_the_one_flat_tensor_and_inputs_stay():
    given = values(0)
    layout = SlotLayout(SLOTS)
    flats = []
    out = layout.fill(given).reduce(lambda flat, kind: flats.append(flat.mul_(2)))
    assert out["sum_sq"].data_ptr() == flats[0].data_ptr()  # the first sum slot
    assert out["shards"].tolist() == [-2.0, 0.0]
    assert given["sum_sq"].tolist() == [1.0, 2.0, 3.0]  # reduced in a copy


def test_reading_a_name_the_step_does_not_carry_fails_naming_what_it_has():
    slots = [s for s in SLOTS if s.name != "max_abs"]
    cheap = SlotLayout(slots)
    pack = cheap.fill(values(0, slots))
    with pytest.raises(KeyError, match="no slot 'max_abs' this step .*sum_sq, loss, shards"):
        pack["max_abs"]
    with pytest.raises(KeyError, match="no slot 'max_abs'"):
        pack.read()["max_abs"]
    with pytest.raises(KeyError, match="no slot 'stop'"):
        cheap.fill(values(0, slots) | {"stop": torch.zeros(1)})
    assert pack.get("max_abs") is None and pack.read().get("max_abs") is None
    assert "max_abs" not in pack and "shards" in pack


def test_a_slot_is_filled_with_its_size_once_and_every_slot_is_filled():
    with pytest.raises(AssertionError, match="holds 3 values, not 2"):
        SlotLayout(SLOTS).fill(values(0) | {"sum_sq": torch.ones(2)})
    with pytest.raises(AssertionError, match="unfilled: \\['shards'\\]"):
        SlotLayout(SLOTS).fill({k: v for k, v in values(0).items() if k != "shards"})
    with pytest.raises(AssertionError, match="declared twice"):
        SlotLayout([*SLOTS, Slot("loss", 1, "max")])


def test_the_host_read_takes_extra_tensors_and_replaced_values_by_name():
    pack = SlotLayout(SLOTS).fill(values(0))
    host = pack.replaced({"loss": torch.tensor([9.0])}).read({"grad_norm": torch.tensor(4.0)})
    assert host["loss"] == [9.0] and host["grad_norm"] == [4.0]
    assert host["sum_sq"] == [1.0, 2.0, 3.0] and host["shards"] == [-1.0, 0.0]
    assert pack["loss"].tolist() == [2.5]  # replaced in a new pack


def test_a_device_only_slot_is_reduced_with_the_others_and_never_read_to_the_host():
    slots = [*SLOTS, Slot("stop", 1, "sum", host=False)]
    layout = SlotLayout(slots)
    mine, theirs = layout.fill(values(0, slots)), layout.fill(values(1, slots))
    reduction = TwoRanks(theirs)
    pack = mine.reduce(reduction)
    assert reduction.calls == [("sum", 5), ("max", 5)]  # in the one SUM all-reduce
    assert pack["stop"].tolist() == [1.0]  # on the device, reduced
    host = pack.read()
    assert "stop" not in host and host["sum_sq"] == [3.0, 6.0, 9.0]
