"""Small tensor helpers shared across layers."""

from __future__ import annotations

import contextlib

import torch


def autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """A region computed in the inputs' own dtypes. Meta tensors (used to check shapes and device
    placement without memory) have no autocast to switch off."""
    if device_type == "meta":
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast computes in on this device type right now, None when it is off."""
    if device_type == "meta" or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)
