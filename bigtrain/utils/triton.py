"""Triton where it can run: CUDA devices, or its CPU interpreter (TRITON_INTERPRET=1, tests).

The kernels (monitor/kernel.py, optim/adamw_kernel.py) import triton themselves and are imported
only where `triton_available` says they run: a CPU run never loads triton (~0.2 s of its start)."""

from __future__ import annotations

import functools
import importlib.util
import os

import torch


@functools.cache
def triton_installed() -> bool:
    """Whether the triton package is installed (found, not imported)."""
    return importlib.util.find_spec("triton") is not None


def triton_available(device: torch.device) -> bool:
    """Triton can launch on this device (CUDA), or runs in its CPU interpreter (TRITON_INTERPRET)."""
    if not triton_installed():
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
