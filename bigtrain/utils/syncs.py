"""Counting host-device synchronisations: the Tensor methods that read a value on the host."""

from __future__ import annotations

from collections.abc import Callable

import torch

SYNC_METHODS = ("item", "cpu", "tolist", "numpy", "__bool__", "__float__", "__int__")


def count_host_syncs(fn: Callable[[], object]) -> int:
    """How many times `fn` called one of SYNC_METHODS (each is a sync when the tensor is on a
    GPU); the CPU-side check that a GPU hot path never waits for the device."""
    calls = [0]
    originals = {name: getattr(torch.Tensor, name) for name in SYNC_METHODS}

    def counting(original):
        def wrapper(self, *args, **kwargs):
            calls[0] += 1
            return original(self, *args, **kwargs)

        return wrapper

    try:
        for name, original in originals.items():
            setattr(torch.Tensor, name, counting(original))
        fn()
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
    return calls[0]
