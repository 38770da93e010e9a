"""How a built model becomes a trained one: one function, one order.

    backend = parallelize(model, cfg, layout, policy, device)

The layout (layout.py) was decided and connected to its DeviceMesh in the run's assembly:
1. tensor parallelism (parallel.tensor_parallel > 1): bigtrain's GPT by its own plan, other
   models by parallel.tp_plan (tensor/plans.py), over the layout's tp axis; then context
   parallelism (parallel.context_parallel > 1): the GPT keeps its chunks of each sequence and its
   attention crosses the cp ranks (context/);
2. activation checkpointing (parallel.activation_checkpointing) and compile (parallel.compile),
   per transformer block (transforms.py);
3. data parallelism: expert parallelism first (parallel.expert_parallel > 1: each MoE layer's
   experts split over the ep ranks, experts.py), then FSDP2's fully_shard per block and
   the root with the policy's mixed precision over the layout's (replicate, shard) mesh, shard
   being shard x cp with context parallelism (fsdp),
   or the model handed to DeepSpeed, which partitions it (zero), or nothing (local); a model
   built on the meta device gets its shards' values here.

With pipeline stages (parallel.pipeline_parallel > 1) the model is first cut into this rank's
stages (pipeline/split.py), and each goes through 1-3 as a model of its own; the backend holds them
with their schedule (pipeline/schedule.py, pipeline/stage_backends.py).

The Backend returned (backends/base.py) then owns the model and its optimizer: the step and its state.
Where the model was built (whole, meta, partitioned) is decided before, in model_setup.py.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from bigtrain.config.parallel import pp_microbatches, pp_stages_per_rank, reshards_after_forward
from bigtrain.config.schema import Config, ParallelConfig, TrainConfig
from bigtrain.errors import ConfigError
from bigtrain.model.hf import HFCausalLM
from bigtrain.model.hf_plans import family_plans, require
from bigtrain.model.hf_routers import router_modules
from bigtrain.parallel.backends.base import Backend
from bigtrain.parallel.backends.fsdp import FSDPBackend, fsdp_mixed_precision
from bigtrain.parallel.backends.local import LocalBackend
from bigtrain.parallel.context.apply import apply_context_parallel
from bigtrain.parallel.experts import apply_expert_parallel
from bigtrain.parallel.layout import Layout
from bigtrain.parallel.meta_init import materialize
from bigtrain.parallel.pipeline.schedule import Pipeline, StageChunks, rank_stages
from bigtrain.parallel.pipeline.split import stage_bounds, stage_module, stage_of_names
from bigtrain.parallel.pipeline.stage_backends import PipelinedFSDP, PipelinedLocal
from bigtrain.parallel.tensor.plans import apply_tensor_parallel
from bigtrain.parallel.transforms import (
    apply_activation_checkpointing,
    apply_compile,
    transformer_blocks,
)
from bigtrain.precision.fp8 import record_fsdp_owners
from bigtrain.precision.policy import PrecisionPolicy


def parallelize(
    model: nn.Module, cfg: Config, layout: Layout, policy: PrecisionPolicy, device: torch.device
) -> Backend:
    """The model parallelized as parallel.* says over `layout` (module docstring), in its
    backend."""
    seed = cfg.train.seed
    if layout.pp > 1:  # this rank's stages, each parallelized as a model of its own
        pipeline = _pipelined(
            model, cfg.parallel, cfg.train, cfg.model.seq_len, layout, policy, device
        )
        if cfg.parallel.backend == "fsdp":
            return PipelinedFSDP(pipeline, policy, cfg.optim, cfg.precision, device, layout, seed)
        return PipelinedLocal(pipeline, policy, cfg.optim, cfg.precision, device)
    if cfg.parallel.backend == "fsdp":
        model = _fully_sharded(model, cfg.parallel, layout, policy, device, seed)
        return FSDPBackend(model, policy, cfg.optim, cfg.precision, device, layout, seed)
    _block_transforms(model, cfg.parallel)
    if cfg.parallel.backend == "zero":
        from bigtrain.parallel.backends.zero import (
            ZeroBackend,
        )  # imports deepspeed: only when asked for

        return ZeroBackend(model, policy, cfg, device, layout)  # DeepSpeed partitions it
    return LocalBackend(model, policy, cfg.optim, cfg.precision, device)


def _block_transforms(model: nn.Module, parallel: ParallelConfig) -> None:
    apply_activation_checkpointing(model, parallel.activation_checkpointing)
    if parallel.compile:
        apply_compile(model)


def _fully_sharded(
    model: nn.Module,
    parallel: ParallelConfig,
    layout: Layout,
    policy: PrecisionPolicy,
    device: torch.device,
    seed: int,
) -> nn.Module:
    assert layout.mesh is not None, "FSDP2 shards over the layout's mesh (Layout.connect)"
    on_meta = any(p.is_meta for p in model.parameters())
    if not on_meta:
        model = model.to(device)
    if layout.tp > 1:  # inside each block first; FSDP2 then shards the DTensors
        apply_tensor_parallel(model, layout.tp_mesh, parallel.tp_plan)
    if layout.cp > 1:  # the sequence split: the model keeps its chunks, attention crosses
        apply_context_parallel(model, layout.context_split())
    _block_transforms(model, parallel)
    # 2D: HSDP, gradients reduce-scattered over shard, then all-reduced over replicate.
    data_mesh, mp = layout.data_mesh, fsdp_mixed_precision(policy)
    reshard = reshards_after_forward(parallel)
    if layout.ep > 1:  # the experts first: each MoE layer's its own FSDP2 group
        apply_expert_parallel(model, layout, mp, reshard)
    # A transformers MoE family's routers are FP32 islands (precision/islands.py): their own
    # groups, gathered in FP32 whatever the rest is gathered in.
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=mp.reduce_dtype)
    for router in family_routers(model):
        fully_shard(router, mesh=data_mesh, mp_policy=fp32, reshard_after_forward=reshard)
    for block in transformer_blocks(model):
        fully_shard(block, mesh=data_mesh, mp_policy=mp, reshard_after_forward=reshard)
    # The root holds embeddings, final norm and lm_head (tied weights stay in one group).
    fully_shard(model, mesh=data_mesh, mp_policy=mp, reshard_after_forward=reshard)
    if on_meta:  # parallel.meta_init: only this rank's shards are ever allocated
        materialize(model, device, seed)
    record_fsdp_owners(model)  # FP8 layers that may later gather in BF16
    return model


def _pipelined(
    model: nn.Module,
    parallel: ParallelConfig,
    train: TrainConfig,
    seq_len: int,
    layout: Layout,
    policy: PrecisionPolicy,
    device: torch.device,
) -> Pipeline:
    """This rank's pipeline chunks, cut from the model (a GPT on the meta device, a transformers
    model whole) and then parallelized and materialized one by one as a whole model would be,
    with their schedule (pipeline/schedule.py)."""
    p, seed = parallel, train.seed
    chunks_per_rank = pp_stages_per_rank(p)
    num_stages = layout.pp * chunks_per_rank
    if isinstance(model, HFCausalLM):  # a family without a pipeline plan: named, with the degree
        require(family_plans(model.hf), "parallel.pipeline_parallel", layout.pp)
        if model.trains_router_loss:  # the family computes it over every layer at once
            raise ConfigError(
                f"key 'parallel.pipeline_parallel' ({layout.pp}): the transformers family "
                f"{model.hf.config.model_type!r} trains with its load-balancing loss "
                "(output_router_logits in model.hf_config), which it computes over every "
                "layer's router logits at once, across pipeline stages; set output_router_logits: "
                "false or parallel.pipeline_parallel=1"
            )
    bounds = stage_bounds(model, num_stages, p.pp_split, seq_len)
    stages = rank_stages(p.pp_schedule, layout.pp, chunks_per_rank, layout.coord("pp"))
    on_meta = any(t.is_meta for t in model.parameters())  # bigtrain's GPT; transformers: whole
    chunks = []
    for s in stages:
        chunk = stage_module(model, bounds[s], bounds[s + 1], s == 0, s == num_stages - 1)
        if p.backend == "fsdp":
            chunk = _fully_sharded(chunk, p, layout, policy, device, seed)
        else:
            _block_transforms(chunk, p)
            if on_meta:
                materialize(chunk, device, seed)
        chunks.append(chunk)
    pipeline = Pipeline(
        StageChunks(chunks),
        stages,
        num_stages,
        p.pp_schedule,
        pp_microbatches(p, train.micro_batch_size),
        layout,
        device,
        model,
        stage_of_names(model, bounds),
    )
    if not on_meta:  # a transformers model's whole build: its storage goes, the stages hold theirs
        model.to("meta")
    return pipeline


def family_routers(model: nn.Module) -> list[nn.Module]:
    """The routers of a transformers MoE family (model/hf_routers.py); none for other models."""
    return [m for _, m in router_modules(model.hf)] if isinstance(model, HFCausalLM) else []
