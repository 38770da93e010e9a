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

A transformers MoE family gets the same placement by the plan it declares (its ep plan's
`grouped_gemm` weights, in the `ep_dispatch_experts` module): `FamilyDispatch` takes the place
of that module's forward, sends the pairs with the same all-to-all and runs the family's own
expert math on the rank's experts (docs/models.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import DataParallelMeshDims, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from bigtrain.errors import ConfigError
from bigtrain.model.hf import HFCausalLM
from bigtrain.model.hf_plans import family_experts, family_plans, require
from bigtrain.model.moe import dispatch_order, expert_parallel, moe_layers
from bigtrain.parallel.layout import Layout
from bigtrain.utils.tensors import local_tensor


def apply_expert_parallel(
    model: nn.Module, layout: Layout, mp: MixedPrecisionPolicy, reshard: bool
) -> None:
    """Split every MoE layer's experts over the layout's ep ranks and shard them with FSDP2
    (before the blocks are: fully_shard of a block then leaves them to their own group)."""
    if isinstance(model, HFCausalLM):
        apply_family_expert_parallel(model, layout, mp, reshard)
        return
    for layer in moe_layers(model):
        names = [n for n, _ in layer.experts.named_parameters(recurse=False)]
        _split(layer.experts, names, layout, mp, reshard)
        layer.ep_group = layout.expert_mesh.get_group("ep")  # type: ignore[union-attr]


def _split(
    experts: nn.Module, names: list[str], layout: Layout, mp: MixedPrecisionPolicy, reshard: bool
) -> None:
    """The module's stacked expert weights `names` split by expert over the ep ranks (Shard(0))
    and FSDP2-sharded over the rest of the data-parallel ranks (Shard(1)), as its own group."""
    mesh = layout.expert_mesh
    assert mesh is not None, "a connected layout with ep > 1"
    replicate, shard = layout.expert_dp_dims
    placements = [Shard(0) if dim == "ep" else Replicate() for dim in mesh.mesh_dim_names]
    for name in names:
        param = experts.get_parameter(name)
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


def apply_family_expert_parallel(
    model: nn.Module, layout: Layout, mp: MixedPrecisionPolicy, reshard: bool
) -> None:
    """A transformers MoE family's experts split by the plan it declares (`base_model_ep_plan`,
    model/hf_plans.py): in each decoder layer, the `ep_dispatch_experts` module's `grouped_gemm`
    weights (stacked by expert on dim 0) split over the ep ranks as bigtrain's own experts are,
    and its forward given the tokens of every ep rank for its experts (`FamilyDispatch`)."""
    plans = family_plans(model.hf)  # type: ignore[union-attr]
    require(plans, "parallel.expert_parallel", layout.ep)
    found = family_experts(model.hf)  # type: ignore[union-attr]
    if not found:
        raise ConfigError(
            f"key 'parallel.expert_parallel' ({layout.ep}): no module of the transformers family "
            f"{plans.model_type!r} matches its declared ep plan {plans.ep}"
        )
    for name, module, weights in found:
        experts = weights and module.get_parameter(weights[0]).shape[0]
        if not experts or experts % layout.ep:
            raise ConfigError(
                f"key 'parallel.expert_parallel' ({layout.ep}) must divide the experts of "
                f"{plans.model_type!r}'s {name} ({experts}): each rank of an expert-parallel "
                "group holds as many"
            )
        group = layout.expert_mesh.get_group("ep")  # type: ignore[union-attr]
        FamilyDispatch(module, experts, experts // layout.ep, group)
        _split(module, weights, layout, mp, reshard)


class FamilyDispatch:
    """A transformers experts module's forward under expert parallelism: called as the family
    calls it, (tokens, top-k expert ids, top-k weights) of this rank's tokens with global ids, it
    sends each token-expert pair to its expert's rank with bigtrain's all-to-all (model/moe.py's
    `expert_parallel`), runs the family's own expert math there on the local experts (its
    forward, with local ids, unit weights and the local slices of its weights), and sums each
    token's weighted outputs back here. The module's `num_experts` becomes the local count."""

    def __init__(
        self, module: nn.Module, experts: int, local: int, group: dist.ProcessGroup
    ) -> None:
        """`experts` of the layer, `local` of them on this rank, split over `group`."""
        self.module, self.experts, self.group = module, experts, group
        self.family_forward = module.forward
        module.num_experts = local
        module.forward = self

    def __call__(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        k = top_k_index.shape[-1]
        order, counts = dispatch_order(top_k_index, self.experts, None)
        y = expert_parallel(self.local, hidden[order // k], counts, self.group)
        slots = y.new_zeros(top_k_index.numel(), hidden.shape[-1]).index_copy(0, order, y)
        weights = top_k_weights.reshape(-1, 1).to(y.dtype)
        return (slots * weights).view(-1, k, hidden.shape[-1]).sum(1).to(hidden.dtype)

    def local(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The family's expert math on rows grouped by local expert (counts[e] rows each)."""
        ids = torch.arange(counts.numel(), device=rows.device).repeat_interleave(counts)
        empty = rows.shape[0] == 0
        if empty:  # one zero row keeps the weights in backward: FSDP2 reduces on every rank
            rows, ids = rows.sum(0, keepdim=True), ids.new_zeros(1)
        ones = rows.new_ones(rows.shape[0], 1)
        with local_parameters(self.module):
            out = self.family_forward(rows, ids.unsqueeze(1), ones)
        return out[:0] if empty else out


@contextlib.contextmanager
def local_parameters(module: nn.Module) -> Iterator[None]:
    """The module's DTensor parameters as their local shards (differentiable) for the span: a
    family's expert math indexes its stacked weights with local expert ids."""
    saved = dict(module._parameters)
    for name, param in saved.items():
        if param is not None and hasattr(param, "to_local"):
            module._parameters[name] = local_tensor(param)  # type: ignore[assignment]
    try:
        yield
    finally:
        module._parameters.update(saved)
