"""The device mesh of the fsdp backend: `replicate x shard` (HSDP) or `shard` alone (FSDP).

Ranks are laid out row-major, so one shard group is a run of contiguous ranks (one node's, where
the shard degree is the node's GPU count): the frequent all-gathers and reduce-scatters stay on the
fast links and only the gradient all-reduce of the replicate dim crosses nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate

from bigtrain.config.schema import ParallelConfig
from bigtrain.errors import ConfigError


@dataclass(frozen=True)
class MeshShape:
    """Sizes of the mesh axes; their product is the world size."""

    replicate: int
    shard: int

    @property
    def axes(self) -> tuple[str, ...]:
        """Named axes, outermost first; a size-1 replicate axis is left out (plain FSDP)."""
        return ("replicate", "shard") if self.replicate > 1 else ("shard",)

    @property
    def sizes(self) -> tuple[int, ...]:
        return (self.replicate, self.shard) if self.replicate > 1 else (self.shard,)

    def describe(self) -> str:
        return " x ".join(
            f"{axis} {size}" for axis, size in zip(self.axes, self.sizes, strict=True)
        )


def mesh_shape(cfg: ParallelConfig, world_size: int) -> MeshShape:
    """The mesh for `world_size` ranks; ConfigError with the numbers when it does not divide."""
    if world_size % cfg.replicate:
        raise ConfigError(
            f"key 'parallel.replicate' ({cfg.replicate}) must divide the world size "
            f"({world_size}): the shard degree is world size / replicate = "
            f"{world_size} / {cfg.replicate}, not an integer"
        )
    return MeshShape(cfg.replicate, world_size // cfg.replicate)


def build_mesh(shape: MeshShape, device_type: str) -> DeviceMesh:
    """The DeviceMesh with named axes (a collective: every rank calls it)."""
    return init_device_mesh(device_type, shape.sizes, mesh_dim_names=shape.axes)


def shard_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """What fully_shard takes: the 2D (replicate, shard) mesh is HSDP, the 1D one is FSDP."""
    return mesh[("replicate", "shard")] if "replicate" in (mesh.mesh_dim_names or ()) else mesh


def replication(tensor: torch.Tensor) -> int:
    """Over how many ranks the tensor's values are repeated: the product of the mesh sizes of
    its Replicate placements (1 for a plain tensor, which each rank holds as its own)."""
    if not isinstance(tensor, DTensor):
        return 1
    mesh = tensor.device_mesh
    count = 1
    for axis, placement in enumerate(tensor.placements):
        if isinstance(placement, Replicate):
            count *= mesh.size(axis)
    return count
