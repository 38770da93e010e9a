"""Build big models without ever holding them whole: on the meta device (shapes only), sharded,
then each rank materialises its shards.

Every parameter's full initial value is drawn, one parameter at a time, on the training device
from a generator seeded by (train.seed, canonical name) (model/init.py); each rank keeps its
slice. The peak extra memory is the largest single parameter, and the weights are those of a
model built whole, at any world size.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from bigtrain.errors import ConfigError
from bigtrain.model.init import initial_value
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


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device, seed: int) -> None:
    """Allocate the (sharded) meta model on `device` and initialise it (see module docstring)."""
    shared = shared_params(model)
    model.to_empty(device=device)  # from meta, each module gets a new tensor: ties are undone
    for owners in shared:
        (first, first_attr), *rest = owners
        for module, attr in rest:
            setattr(module, attr, getattr(first, first_attr))
    for _, buffer in model.named_buffers():
        if buffer.is_floating_point():
            buffer.zero_()  # e.g. INT8 calibration state; tables are recomputed below
    assert hasattr(model, "init_value"), "meta init needs a model with init_value (bigtrain's GPT)"
    for name, param in model.named_parameters():
        full = initial_value(model, canonical_name(name), param.shape, device, seed)
        if isinstance(param, DTensor):
            # src_data_rank=None: every rank slices its own copy, no communication.
            shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(shard.to_local())
        else:
            param.copy_(full)
        del full
    model.init_buffers()  # type: ignore[operator]


def shared_params(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """The (module, attribute) owners of each parameter that several modules share (tied
    embeddings), to tie again after `to_empty`."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for attr, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append((module, attr))
    return [o for o in owners.values() if len(o) > 1]
