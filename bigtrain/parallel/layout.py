"""The one parallel layout of a run: every dimension's size, this rank's coordinate in each, and
the numbers derived from them. Decided once per process (`Layout.of`, in the run's assembly and in
`bigtrain plan`) and passed down; nothing else divides the world size.

Dimensions, outermost first (docs/parallelism.md):

    ft         fault-tolerant replica groups: separate jobs that may die and rejoin (torchft);
               1 until fault tolerance is on. A job's ranks are the dimensions below.
    pp         pipeline stages; 1 until pipeline parallelism is on.
    replicate  HSDP replicas of the sharded model (parallel.replicate).
    shard      FSDP2 shards or ZeRO partitions: what is left of the world.
    cp         context parallelism (parallel.context_parallel): ranks of one model copy that
               split each sequence between them and share its loss (parallel/context/);
               FSDP2 shards over shard x cp.
    tp         tensor parallelism (parallel.tensor_parallel), innermost: a tp group is a run of
               consecutive ranks (one node's GPUs, for its per-layer collectives).
    ep         expert parallelism: a sub-group of a replica's shard ranks that splits the experts
               (consecutive shard ranks); 1 until mixture-of-experts models.

Within a job, ranks are numbered row-major over (pp, replicate, shard, cp, tp). The data-parallel
ranks are (ft, replicate, shard) flattened: each reads its own slice of the global batch; the cp
and tp ranks and pipeline stages of one data-parallel rank read the same slice (the cp ranks
then keep their chunks of each sequence). Only the replicate axis's
once-a-step all-reduce crosses replicas, and only the ft axis crosses jobs.

A planned layout (no process group) and a run's are the same class: `connect()` adds the
DeviceMesh of the run, a collective every rank calls once.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate

from bigtrain.config.schema import ParallelConfig, TrainConfig
from bigtrain.errors import SharedConfigError
from bigtrain.parallel.context.split import ContextSplit

JOB_AXES = ("pp", "replicate", "shard", "cp", "tp")
"""The axes of one job's ranks, outermost first (row-major rank order)."""
MESH_AXES = ("replicate", "shard", "cp", "tp")
"""The axes the DeviceMesh holds (size-1 replicate, cp and tp left out)."""


@dataclass(frozen=True)
class Layout:
    """Sizes of every dimension, this rank's place, and the groups (after `connect`)."""

    world_size: int
    """Ranks of this job (one fault-tolerant replica group)."""
    rank: int = 0
    pp: int = 1
    replicate: int = 1
    shard: int = 1
    cp: int = 1
    cp_style: str = "ring"
    tp: int = 1
    ep: int = 1
    ft: int = 1
    """Fault-tolerant replica groups (jobs)."""
    ft_group: int = 0
    """This job's replica group."""
    mesh: DeviceMesh | None = field(default=None, compare=False, repr=False)
    """The DeviceMesh over MESH_AXES once connected (every backend with a process group; FSDP2
    and tensor parallelism shard over it); None before, and in one process without a group."""
    expert_mesh: DeviceMesh | None = field(default=None, compare=False, repr=False)
    """With ep > 1, once connected: the same ranks with `shard` unflattened into (`edp`, `ep`):
    the experts are split over ep and FSDP2-sharded over edp (and replicated over replicate)."""
    sharded_mesh: DeviceMesh | None = field(default=None, compare=False, repr=False)
    """With cp > 1, once connected: the data mesh, (replicate, shard_cp) or shard_cp, the shard
    and cp ranks flattened into the one axis FSDP2 shards over."""

    def __post_init__(self) -> None:
        assert self.pp * self.replicate * self.shard * self.cp * self.tp == self.world_size, (
            "the job's dimensions multiply to its world size (Layout.of checks the config)"
        )
        assert 0 <= self.rank < self.world_size and 0 <= self.ft_group < self.ft

    @classmethod
    def of(
        cls, cfg: ParallelConfig, world_size: int, rank: int = 0, ft: int = 1, ft_group: int = 0
    ) -> Layout:
        """The layout of `world_size` ranks (one job) under parallel.*, in replica group
        `ft_group` of `ft` (fault_tolerance.groups); ConfigError with the keys and the numbers
        when they do not divide."""
        pp, cp = cfg.pipeline_parallel, cfg.context_parallel
        model_copies = pp * cfg.replicate * cp * cfg.tensor_parallel
        if world_size % model_copies:
            stages = f"parallel.pipeline_parallel ({pp}) x " if pp > 1 else ""
            context = f"parallel.context_parallel ({cp}) x " if cp > 1 else ""
            raise SharedConfigError(
                f"key {stages}'parallel.replicate' ({cfg.replicate}) x {context}"
                f"parallel.tensor_parallel ({cfg.tensor_parallel}) = {model_copies} must divide "
                f"the world size ({world_size}): the shard degree is world size / "
                f"({'pipeline_parallel x ' if pp > 1 else ''}replicate x "
                f"{'context_parallel x ' if cp > 1 else ''}tensor_parallel) = "
                f"{world_size} / {model_copies}, not an integer"
            )
        shard = world_size // model_copies
        if shard % cfg.expert_parallel:
            raise SharedConfigError(
                f"key 'parallel.expert_parallel' ({cfg.expert_parallel}) must divide the shard "
                f"degree ({shard} = world size {world_size} / {model_copies}): an expert-parallel "
                "group is a run of one replica's shard ranks"
            )
        if cfg.backend == "local" and pp > 1 and shard * cfg.replicate * cfg.tensor_parallel != 1:
            raise SharedConfigError(
                f"parallel.backend=local runs one process per pipeline stage (parallel."
                f"pipeline_parallel={pp}), but the launcher started {world_size}; use "
                "parallel.backend=fsdp to shard each stage over more ranks"
            )
        return cls(
            world_size,
            rank,
            pp=pp,
            replicate=cfg.replicate,
            shard=shard,
            cp=cp,
            cp_style=cfg.cp_style,
            tp=cfg.tensor_parallel,
            ep=cfg.expert_parallel,
            ft=ft,
            ft_group=ft_group,
        )

    def at_rank(self, rank: int) -> Layout:
        """The same layout seen from another rank (without the mesh, which is this rank's)."""
        return dataclasses.replace(self, rank=rank, mesh=None, expert_mesh=None, sharded_mesh=None)

    # --- coordinates -------------------------------------------------------------------------

    def size(self, axis: str) -> int:
        return getattr(self, axis)

    @property
    def coords(self) -> dict[str, int]:
        """This rank's coordinate on every axis (ft: its job's replica group; ep: its place in
        the expert-parallel group among consecutive shard ranks)."""
        out, rest = {}, self.rank
        for axis in reversed(JOB_AXES):
            rest, out[axis] = divmod(rest, self.size(axis))
        return {"ft": self.ft_group, **dict(reversed(out.items())), "ep": out["shard"] % self.ep}

    def coord(self, axis: str) -> int:
        return self.coords[axis]

    # --- what the rest of bigtrain asks ------------------------------------------------------

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks over all replica groups: each reads its own slice of the batch."""
        return self.ft * self.replicate * self.shard

    @property
    def dp_rank(self) -> int:
        """The slice of the global batch this rank reads; the tp ranks and pipeline stages of one
        data-parallel rank read the same one."""
        c = self.coords
        return (self.ft_group * self.replicate + c["replicate"]) * self.shard + c["shard"]

    @property
    def model_size(self) -> int:
        """Ranks that hold one model copy between them (the ranks of one data-parallel rank)."""
        return self.pp * self.cp * self.tp

    @property
    def loss_ranks(self) -> int:
        """Ranks of this job that hold a loss (the last pipeline stage's); the mean loss over the
        job is their sum over this many. The tp ranks of a data-parallel rank hold the same
        loss, so the mean over them equals the mean over data-parallel ranks; its cp ranks each
        hold the mean over their equal share of its tokens, whose mean is the whole one."""
        return self.stage_size  # the last stage's ranks

    @property
    def stage_size(self) -> int:
        """Ranks of one pipeline stage (the whole job without stages); the ranks of stage s are
        s x stage_size onwards, in the stage's own (replicate, shard, tp) order."""
        return self.world_size // self.pp

    @property
    def shard_ranks(self) -> int:
        """The ranks FSDP2 shards one model copy over: shard x cp (the cp ranks of a copy hold
        its shards between them like data ranks)."""
        return self.shard * self.cp

    @property
    def holds_loss(self) -> bool:
        return self.coords["pp"] == self.pp - 1

    @property
    def distributed(self) -> bool:
        """More than one rank in this job: collectives have something to do."""
        return self.world_size > 1

    def describe(self) -> str:
        """`replicate 2 x shard 4 x tp 2`: the axes with a size above 1 (shard always)."""
        parts = [f"{axis} {self.size(axis)}" for axis in ("ft", "pp") if self.size(axis) > 1]
        parts += [f"{a} {n}" for a, n in zip(self.mesh_axes, self.mesh_sizes, strict=True)]
        return " x ".join(parts + ([f"ep {self.ep}"] if self.ep > 1 else []))

    # --- the global batch --------------------------------------------------------------------

    def global_batch(self, micro_batch_size: int, grad_accum_steps: int) -> int:
        """Sequences per optimizer step over every data-parallel rank."""
        return micro_batch_size * grad_accum_steps * self.dp_size

    def batch(self, train: TrainConfig) -> TrainConfig:
        """`train` with grad_accum_steps derived from train.global_batch_size (when set) for this
        layout's data-parallel ranks; ConfigError with the numbers when it does not divide."""
        if train.global_batch_size is None:
            return train
        label = "world size" if self.dp_size == self.world_size else "data-parallel size"
        per_step = train.micro_batch_size * self.dp_size
        accum, rest = divmod(train.global_batch_size, per_step)
        if rest or accum == 0:
            raise SharedConfigError(
                f"key 'train.global_batch_size' ({train.global_batch_size}) must be a positive "
                f"multiple of train.micro_batch_size ({train.micro_batch_size}) x {label} "
                f"({self.dp_size}) = {per_step}"
            )
        if train.grad_accum_steps not in (1, accum):
            raise SharedConfigError(
                f"key 'train.grad_accum_steps' ({train.grad_accum_steps}) disagrees with "
                f"train.global_batch_size ({train.global_batch_size}), which gives {accum} at "
                f"{label} {self.dp_size}: set one of them"
            )
        return dataclasses.replace(train, grad_accum_steps=accum)

    def keep_global_batch(
        self, train: TrainConfig, saved: int, saved_micro: int | None
    ) -> tuple[TrainConfig, str | None]:
        """`train` split anew so that a resumed checkpoint's global batch (`saved` sequences)
        stays at this layout's data-parallel size, and a line saying what changed (None when
        nothing did). train.global_batch_size, when set, is the user's word (the resume's
        identity check compares it). The micro-batch stays where it divides the per-rank batch
        or was set for this run (`saved_micro`: the checkpoint's own); else it is lowered to the
        largest that does (a memory knob never grows), and the accumulation makes up the rest.
        ConfigError with the numbers and the keys when the batch cannot be kept."""
        old_micro, old_accum = train.micro_batch_size, train.grad_accum_steps
        current = self.global_batch(old_micro, old_accum)
        if current == saved or train.global_batch_size is not None:
            return train, None
        per_rank, rest = divmod(saved, self.dp_size)
        chosen = old_micro != saved_micro and saved_micro is not None  # set for this resume
        if rest or (chosen and per_rank % old_micro):
            why = (
                f"{saved} is not a multiple of the {self.dp_size} data-parallel ranks"
                if rest
                else f"train.micro_batch_size={old_micro} does not divide the {per_rank} "
                "sequences each rank takes"
            )
            raise SharedConfigError(
                f"the checkpoint's global batch of {saved} sequences cannot be kept at "
                f"{self.dp_size} data-parallel ranks ({why}); this run's config gives {current} "
                f"(train.micro_batch_size {old_micro} x train.grad_accum_steps {old_accum} x "
                f"{self.dp_size} ranks): launch a number of ranks that divides {saved}, or set "
                "train.global_batch_size and checkpoint.allow_config_change=true to change it"
            )
        micro = max(m for m in range(1, old_micro + 1) if per_rank % m == 0)
        accum = per_rank // micro
        changed = [
            f"train.{key} {old} -> {new}"
            for key, old, new in (
                ("micro_batch_size", old_micro, micro),
                ("grad_accum_steps", old_accum, accum),
            )
            if old != new
        ]
        note = (
            f"global batch kept at {saved} sequences on {self.dp_size} data-parallel ranks: "
            f"{', '.join(changed)} (this config gives {current} here)"
        )
        return dataclasses.replace(train, micro_batch_size=micro, grad_accum_steps=accum), note

    # --- the DeviceMesh and process groups ---------------------------------------------------

    @property
    def mesh_axes(self) -> tuple[str, ...]:
        """The named axes of a stage's DeviceMesh, outermost first; size-1 replicate and tp left
        out (connect puts `pp` outside them when there are stages)."""
        return tuple(a for a in MESH_AXES if self.size(a) > 1 or a == "shard")

    @property
    def mesh_sizes(self) -> tuple[int, ...]:
        return tuple(self.size(a) for a in self.mesh_axes)

    def connect(self, device_type: str) -> Layout:
        """This layout with its DeviceMesh (a collective: every rank calls it, once); itself
        where no process group was started (one process on the local backend). A one-axis
        mesh over the whole world is the default group: no new group is made. With pipeline
        stages the mesh's outermost axis is `pp` (each stage's FSDP2 and tp sub-meshes are the
        same as without it)."""
        if not dist.is_initialized():
            return self
        # The mesh is this job's: replica groups meet only through torchft (parallel/replicas/groups.py).
        axes = (("pp",) if self.pp > 1 else ()) + self.mesh_axes
        sizes = ((self.pp,) if self.pp > 1 else ()) + self.mesh_sizes
        mesh = init_device_mesh(device_type, sizes, mesh_dim_names=axes)
        sharded = None
        if self.cp > 1:  # FSDP2 shards over the shard and cp ranks (data_mesh)
            stage = mesh[self.mesh_axes] if self.pp > 1 else mesh
            dims = ("replicate", "shard", "cp") if self.replicate > 1 else ("shard", "cp")
            sharded = stage[dims]._flatten("_".join(dims))
            if self.replicate > 1:
                sizes = (self.replicate, self.shard * self.cp)
                sharded = sharded._unflatten(0, sizes, ("replicate", "shard_cp"))
        experts = None
        if self.ep > 1 and self.cp > 1:
            experts = self._experts_across_cp(device_type)
        elif self.ep > 1:  # within a stage: the experts' DTensors never span pipeline ranks
            stage = mesh[self.mesh_axes] if self.pp > 1 else mesh
            experts = stage._unflatten("shard", (self.shard // self.ep, self.ep), ("edp", "ep"))
        return dataclasses.replace(self, mesh=mesh, expert_mesh=experts, sharded_mesh=sharded)

    def _experts_across_cp(self, device_type: str) -> DeviceMesh:
        """The expert mesh under context parallelism: (replicate, edp, cp, ep). An ep group is a
        run of shard ranks that hold the same chunks (one cp coordinate), so in rank order ep
        lies between edp and cp; FSDP2 flattens its data-parallel shard dims (edp, cp) only
        when they are adjacent, so the mesh is built from the ranks permuted (a collective,
        over every stage's ranks; this rank keeps its stage's part)."""
        edp = self.shard // self.ep
        ranks = torch.arange(self.world_size).reshape(
            self.pp, self.replicate, edp, self.ep, self.cp
        )
        names = ("pp", "replicate", "edp", "cp", "ep")
        mesh = DeviceMesh(device_type, ranks.permute(0, 1, 2, 4, 3), mesh_dim_names=names)
        keep = names[1:] if self.replicate > 1 else names[2:]
        return mesh[keep]

    def group(self, axis: str) -> dist.ProcessGroup | None:
        """The process group of this rank's `axis` (None where the axis has one rank, or in a
        layout without a mesh)."""
        if self.mesh is None or self.size(axis) == 1:
            return None
        return self.mesh.get_group(axis)

    @property
    def data_mesh(self) -> DeviceMesh:
        """What fully_shard takes: (replicate, shard) is HSDP, shard alone FSDP; with cp ranks
        `shard` is shard x cp flattened (`shard_cp`): they hold one model copy between them, and
        their gradients are averaged like the data ranks' (each rank's loss is its tokens')."""
        assert self.mesh is not None, "connect() first"
        if self.sharded_mesh is not None:
            return self.sharded_mesh
        return self.mesh[("replicate", "shard")] if self.replicate > 1 else self.mesh["shard"]

    def own_tokens(self, t: torch.Tensor) -> torch.Tensor:
        """The part of a tensor holding whole sequences (dim 1) whose tokens this rank computes:
        its chunks under context parallelism (the model cut its inputs alike), else all; for
        the loss's targets, wherever a loss is taken (backends, pipeline stages)."""
        split = self.context_split()
        return t if split is None else split.local(t)

    def context_split(self) -> ContextSplit | None:
        """This rank's place among the cp ranks of its model copy (None without cp)."""
        if self.cp == 1:
            return None
        return ContextSplit(self.cp, self.coord("cp"), self.cp_style, self.group("cp"))

    @property
    def expert_dp_dims(self) -> tuple[str | None, str | tuple[str, str]]:
        """The expert mesh's (replicate, shard) data-parallel dimension names for FSDP2: edp,
        and the cp ranks beside it (FSDP2 flattens the two)."""
        shard = ("edp", "cp") if self.cp > 1 else "edp"
        return ("replicate" if self.replicate > 1 else None), shard

    @property
    def tp_mesh(self) -> DeviceMesh:
        assert self.mesh is not None and self.tp > 1, "a connected layout with tp > 1"
        return self.mesh["tp"]

    @property
    def replica_group(self) -> dist.ProcessGroup | None:
        """The ranks holding the same shards as this one (HSDP replicas); None without."""
        return self.group("replicate")

    def replication(self, tensor: torch.Tensor) -> int:
        """Over how many ranks of the job the tensor's values are repeated: the sizes of its
        DTensor's Replicate placements, times the ranks outside its mesh (a norm gain sharded
        over `shard` only is the same on every rank of a tp group); 1 for a plain tensor, which
        each rank holds as its own."""
        if not isinstance(tensor, DTensor):
            return 1
        mesh = tensor.device_mesh
        repeated = [
            mesh.size(i) for i, p in enumerate(tensor.placements) if isinstance(p, Replicate)
        ]
        # A DTensor's mesh lies inside one pipeline stage: the other stages hold other tensors.
        return self.world_size // self.pp // mesh.size() * math.prod(repeated)
