"""The initial weights of bigtrain's GPT: one definition for every backend and world size.

Each parameter is drawn from a generator of its own, seeded by (train.seed, canonical name), on
the device it is drawn on (CPU and CUDA generators differ, so the values are a function of seed,
name and device type). A value therefore does not depend on which other parameters exist, on the
order they are built in, or on which rank draws it: a model built whole draws every parameter in
place (`GPT(cfg, init_seed)`); one built on the meta device (FSDP2, parallel.meta_init) or
partitioned by ZeRO-3's zero.Init is built undrawn, and each rank later draws one full parameter
at a time and keeps its slice. Tied weights are one parameter, so one draw.

transformers models (model.kind=hf) keep transformers' own init, from the global RNG that
train.seed seeds.
"""

from __future__ import annotations

import torch
from torch import nn

from bigtrain.utils.seeds import derived_seed


def param_seed(seed: int, name: str) -> int:
    """The generator seed of parameter `name` (canonical) in a run seeded with `seed`."""
    return derived_seed("bigtrain-init", seed, name)


def initial_value(
    model: nn.Module, name: str, shape: torch.Size, device: torch.device, seed: int
) -> torch.Tensor:
    """The full FP32 initial value of parameter `name` (canonical) of `model`, which must define
    `init_value(name, shape, device, generator)` (bigtrain's GPT: its init rules)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(param_seed(seed, name))
    return model.init_value(name, shape, device, generator)  # type: ignore[operator]
