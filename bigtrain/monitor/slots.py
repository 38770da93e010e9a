"""The monitor's per-step collectives, packed by name: contributors declare slots, readers ask by
name.

Every step the monitor reduces a dozen small contributions over the ranks: the gradient
statistics and the loss, the preemption flag, the HSDP probe's replica flags, an MoE model's
router sums and extremes, the suspicion tier's shard statistics. One flat all-reduce per kind
(SUM, MAX) is right: on payloads this small a collective costs its latency, so ten contributions
in one tensor cost what one does, and one concatenated host read is the step's one device sync.
Unpacking it by hand-computed offsets is not: each contribution's position depends on every one
before it and on which are present this step (max |g| on full steps only), so the next payload
shifts them all, and a wrong offset reads another contribution's numbers without an error.

So a contributor declares a `Slot` (its name, size and reduction); a step's `SlotLayout` lists the
slots it carries, and the layout's `fill` takes the step's tensors by name into a `Pack`. The pack
concatenates the slots of each kind into one flat tensor in declared order (`flat`), reduces each
with one call (`reduce`), and hands back views by name; `read` is the step's one host read, with
host lists by name (`HostValues`). A slot a step does not carry is absent from its layout: reading
it fails with the names the layout has, never with someone else's numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from itertools import islice
from typing import Literal, get_args

import torch

Reduction = Literal["sum", "max"]
REDUCTIONS: tuple[Reduction, ...] = get_args(Reduction)


@dataclass(frozen=True)
class Slot:
    """One contribution to the step's collectives: `size` float32 values reduced by `reduce`."""

    name: str
    size: int
    reduce: Reduction
    host: bool = True
    """Read to the host with the step's numbers; False: used on the device only (the gradient
    checksums' vectors, whose residuals are read instead)."""

    def __post_init__(self) -> None:
        assert self.size >= 0, f"slot {self.name!r}: a size of at least 0, not {self.size}"
        assert self.reduce in REDUCTIONS, f"slot {self.name!r}: reduce in {REDUCTIONS}"


def _missing(name: str, names: Iterable[str]) -> KeyError:
    return KeyError(f"no slot {name!r} this step (it has {', '.join(names)})")


class SlotLayout:
    """The slots one kind of step carries, in declared order: each reduction's packing order."""

    def __init__(self, slots: Iterable[Slot]) -> None:
        self.slots: dict[str, Slot] = {}
        for slot in slots:
            assert slot.name not in self.slots, f"slot {slot.name!r} is declared twice"
            self.slots[slot.name] = slot

    def __contains__(self, name: str) -> bool:
        return name in self.slots

    def __getitem__(self, name: str) -> Slot:
        if name not in self.slots:
            raise _missing(name, self.slots)
        return self.slots[name]

    def of(self, reduce: Reduction) -> list[Slot]:
        """The slots reduced by `reduce`, in packing order."""
        return [s for s in self.slots.values() if s.reduce == reduce]

    def fill(self, values: Mapping[str, torch.Tensor]) -> Pack:
        """This step's tensors by slot name, each flattened to float32 (no copy when it is);
        every slot filled; a name the layout does not declare is a KeyError."""
        absent = [name for name in self.slots if name not in values]
        assert not absent, f"slots left unfilled: {absent}"
        return Pack(self, values)


class Pack:
    """A layout's slots filled with one step's device tensors, read by name."""

    def __init__(self, layout: SlotLayout, values: Mapping[str, torch.Tensor]) -> None:
        self.layout = layout
        self.values: dict[str, torch.Tensor] = {}
        for name, value in values.items():
            flat = value.float().reshape(-1)
            size = layout[name].size
            assert flat.numel() == size, f"slot {name!r} holds {size} values, not {flat.numel()}"
            self.values[name] = flat

    def __contains__(self, name: str) -> bool:
        return name in self.values

    def __getitem__(self, name: str) -> torch.Tensor:
        """The slot's values on the device: a view of the reduced flat tensor after `reduce`."""
        if name not in self.values:
            raise _missing(name, self.values)
        return self.values[name]

    def get(self, name: str) -> torch.Tensor | None:
        """The slot's values, or None where this step does not carry it."""
        return self.values.get(name)

    def replaced(self, values: Mapping[str, torch.Tensor]) -> Pack:
        """The same slots with some values replaced (by name): the pack after a further
        reduction or a rescaling."""
        return Pack(self.layout, self.values | dict(values))

    def flat(self, reduce: Reduction) -> torch.Tensor | None:
        """The slots of one kind in one new flat tensor (None when the step has none of them)."""
        slots = self.layout.of(reduce)
        return torch.cat([self.values[s.name] for s in slots]) if slots else None

    def reduce(self, reduction: Callable[[torch.Tensor, Reduction], None]) -> Pack:
        """One `reduction(flat, kind)` call per kind the step carries, in place on its flat
        tensor (an all-reduce); the reduced pack's values are views of those tensors."""
        values = dict(self.values)
        for kind in REDUCTIONS:
            flat = self.flat(kind)
            if flat is None:
                continue
            reduction(flat, kind)
            slots = self.layout.of(kind)
            parts = flat.split([s.size for s in slots])
            values.update(zip([s.name for s in slots], parts, strict=True))
        return Pack(self.layout, values)

    def read(self, extra: Mapping[str, torch.Tensor] | None = None) -> HostValues:
        """Every slot read on the host (`Slot.host`) and the `extra` named tensors, in one
        device-to-host copy."""
        extra = extra or {}
        assert not set(extra) & set(self.values), "an extra value is named like a slot"
        read = {k: v for k, v in self.values.items() if self.layout[k].host}
        tensors = read | {k: v.float().reshape(-1) for k, v in extra.items()}
        # Expensive device-to-host synchronization: the step's decision, one read per step.
        host = iter(torch.cat(list(tensors.values())).tolist())
        return HostValues({name: list(islice(host, t.numel())) for name, t in tensors.items()})


@dataclass
class HostValues:
    """A pack's values on the host: a list of floats per name."""

    values: dict[str, list[float]]

    def __contains__(self, name: str) -> bool:
        return name in self.values

    def __getitem__(self, name: str) -> list[float]:
        if name not in self.values:
            raise _missing(name, self.values)
        return self.values[name]

    def get(self, name: str) -> list[float] | None:
        """The slot's host values, or None where this step does not carry it."""
        return self.values.get(name)
