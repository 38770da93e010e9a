"""The device mesh of the fsdp backend: `replicate x shard x tp`, size-1 axes left out
(`shard` alone is FSDP; with `replicate` HSDP; with `tp` tensor parallelism inside).

Ranks are laid out row-major, tp innermost: a tp group is a run of consecutive ranks (one node's
GPUs, for its per-layer collectives), then the shard groups; the replicate axis is outermost, so
only its once-a-step gradient all-reduce crosses replicas.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate

from bigtrain.config.load import for_world_size
from bigtrain.config.schema import Config, ParallelConfig
from bigtrain.errors import ConfigError


@dataclass(frozen=True)
class MeshShape:
    """Sizes of the mesh axes; their product is the world size."""

    replicate: int
    shard: int
    tp: int = 1

    @property
    def axes(self) -> tuple[str, ...]:
        """Named axes, outermost first; size-1 replicate and tp axes are left out."""
        return tuple(a for a, n in zip(AXES, self._all, strict=True) if n > 1 or a == "shard")

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(n for a, n in zip(AXES, self._all, strict=True) if n > 1 or a == "shard")

    @property
    def _all(self) -> tuple[int, int, int]:
        return (self.replicate, self.shard, self.tp)

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: every replica and shard rank reads its own slice of the batch."""
        return self.replicate * self.shard

    def dp_rank(self, rank: int) -> int:
        """The slice of the batch `rank` reads; the ranks of one tp group read the same one."""
        return rank // self.tp  # tp is the innermost axis: consecutive ranks form a tp group

    def describe(self) -> str:
        return " x ".join(
            f"{axis} {size}" for axis, size in zip(self.axes, self.sizes, strict=True)
        )


AXES = ("replicate", "shard", "tp")


def mesh_shape(cfg: ParallelConfig, world_size: int) -> MeshShape:
    """The mesh for `world_size` ranks; ConfigError with the numbers when it does not divide."""
    model_copies = cfg.replicate * cfg.tensor_parallel
    if world_size % model_copies:
        raise ConfigError(
            f"key 'parallel.replicate' ({cfg.replicate}) x parallel.tensor_parallel "
            f"({cfg.tensor_parallel}) = {model_copies} must divide the world size ({world_size}): "
            f"the shard degree is world size / (replicate x tensor_parallel) = "
            f"{world_size} / {model_copies}, not an integer"
        )
    return MeshShape(cfg.replicate, world_size // model_copies, cfg.tensor_parallel)


def for_mesh(cfg: Config, world_size: int) -> Config:
    """`cfg` with train.global_batch_size turned into grad_accum_steps for the data-parallel ranks
    of its mesh at `world_size` (the ranks of a tp group share a batch); ConfigError with the
    numbers when the mesh or the batch does not divide."""
    dp_size = mesh_shape(cfg.parallel, world_size).dp_size
    label = "world size" if dp_size == world_size else "data-parallel size"
    return for_world_size(cfg, dp_size, label)


def build_mesh(shape: MeshShape, device_type: str) -> DeviceMesh:
    """The DeviceMesh with named axes (a collective: every rank calls it)."""
    return init_device_mesh(device_type, shape.sizes, mesh_dim_names=shape.axes)


def shard_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """What fully_shard takes: the 2D (replicate, shard) mesh is HSDP, the 1D one is FSDP."""
    names = mesh.mesh_dim_names or ()
    if "replicate" in names:
        return mesh[("replicate", "shard")]
    return mesh if len(names) == 1 else mesh["shard"]


def replication(tensor: torch.Tensor) -> int:
    """Over how many ranks the tensor's values are repeated: the product of the mesh sizes of
    its Replicate placements, times the ranks outside its mesh (a norm gain sharded over
    `shard` only is the same on every rank of a tp group); 1 for a plain tensor, which each rank
    holds as its own."""
    if not isinstance(tensor, DTensor):
        return 1
    mesh = tensor.device_mesh
    count = dist.get_world_size() // mesh.size()
    for axis, placement in enumerate(tensor.placements):
        if isinstance(placement, Replicate):
            count *= mesh.size(axis)
    return count
