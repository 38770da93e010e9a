"""Build big models without ever holding them whole: on the meta device (shapes only), sharded,
then each rank materialises its shards.

Every parameter's full initial value is drawn, one parameter at a time, on the training device
from a generator seeded by (train.seed, canonical name); each rank keeps its slice. The peak
extra memory is the largest single parameter, and the weights are the same at any world size
(though not the same draws as a model built whole, which consumes one global RNG stream).
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from bigtrain.errors import ConfigError
from bigtrain.utils.names import canonical_name

META_INIT_PARAMS = 1_000_000_000  # parallel.meta_init=auto turns on from here


def uses_meta_init(choice: bool | None, backend: str, kind: str, num_params: int) -> bool:
    """Whether to build on the meta device: `parallel.meta_init`, or auto (FSDP2, >= 1B)."""
    if choice is None:
        return backend == "fsdp" and kind == "gpt" and num_params >= META_INIT_PARAMS
    if choice and (backend != "fsdp" or kind != "gpt"):
        raise ConfigError(
            "parallel.meta_init=true needs parallel.backend=fsdp and model.kind=gpt (bigtrain's "
            "GPT knows how to initialise each parameter on its own)"
        )
    return choice


def _seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"bigtrain-init:{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device, seed: int) -> None:
    """Allocate the (sharded) meta model on `device` and initialise it (see module docstring)."""
    model.to_empty(device=device)
    for _, buffer in model.named_buffers():
        if buffer.is_floating_point():
            buffer.zero_()  # e.g. INT8 calibration state; tables are recomputed below
    root = model
    init_value = getattr(root, "init_value", None)
    assert init_value is not None, "meta init needs a model with init_value (bigtrain's GPT)"
    generator = torch.Generator(device=device)
    for name, param in model.named_parameters():
        generator.manual_seed(_seed(seed, canonical_name(name)))
        full = init_value(canonical_name(name), param.shape, device, generator)
        if isinstance(param, DTensor):
            # src_data_rank=None: every rank slices its own copy, no communication.
            shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(shard.to_local())
        else:
            param.copy_(full)
        del full
    root.init_buffers()  # type: ignore[operator]
