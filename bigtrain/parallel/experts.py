"""Expert parallelism (parallel.expert_parallel; docs/moe.md): each MoE layer's experts split
over the `ep` ranks of the layout's expert mesh, FSDP2-sharded over the rest of the data-parallel
ranks.

The experts' stacked weights (experts, in, out) become DTensors on the expert mesh (replicate,
edp, ep; with context parallelism replicate, edp, cp, ep, see Layout._experts_across_cp):
Shard(0) over ep (a run of experts / ep experts per rank), Replicate over the data dimensions,
which FSDP2 then shards (on dim 1: dim 0 is taken by ep) and reduces over. The layer
sends its tokens to their experts' ranks and back with all-to-all (model/moe.py). Each rank's
expert gradient sums the contributions of every ep peer's tokens, while FSDP2 averages over edp
(and replicate) only: the divide factor is set to every data-parallel rank of the job, so an
expert's gradient is the mean over the same tokens as every other parameter's.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import DataParallelMeshDims, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from bigtrain.model.moe import moe_layers
from bigtrain.parallel.layout import Layout


def apply_expert_parallel(
    model: nn.Module, layout: Layout, mp: MixedPrecisionPolicy, reshard: bool
) -> None:
    """Split every MoE layer's experts over the layout's ep ranks and shard them with FSDP2
    (before the blocks are: fully_shard of a block then leaves them to their own group)."""
    mesh = layout.expert_mesh
    assert mesh is not None, "a connected layout with ep > 1"
    replicate, shard = layout.expert_dp_dims
    placements = [Shard(0) if dim == "ep" else Replicate() for dim in mesh.mesh_dim_names]
    for layer in moe_layers(model):
        experts = layer.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            # src_data_rank=None: each rank keeps its own slice of its copy (a meta build: shapes).
            tensor = distribute_tensor(param.data, mesh, placements, src_data_rank=None)
            experts.register_parameter(name, nn.Parameter(tensor, param.requires_grad))
        fully_shard(
            experts,
            mesh=mesh,
            mp_policy=mp,
            reshard_after_forward=reshard,
            dp_mesh_dims=DataParallelMeshDims(shard=shard, replicate=replicate),
            shard_placement_fn=lambda _: Shard(1),
        )
        # every data-parallel rank of the job, and each one's cp ranks (their losses are means
        # over their own tokens)
        ranks = layout.replicate * layout.shard_ranks
        experts.set_gradient_divide_factor(float(ranks))  # type: ignore[operator]
        if layout.shard_ranks > layout.ep and dist.get_backend() == "gloo":
            # FSDP2 scales by 1 / factor in the reduce-scatter over edp (x cp) when that group's
            # size is not the factor: PREMUL_SUM, which gloo lacks; sum, then divide
            experts.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
        layer.ep_group = mesh.get_group("ep")
