"""Tensor parallelism from outside the model: `parallelize_module` over the mesh's tp axis.

bigtrain's GPT has a plan of its own (`apply_gpt_plan`, Megatron-style with sequence and loss
parallelism); a `model.kind=hf` model by `parallel.tp_plan` (module name patterns inside a
transformer block -> a style) or, when that is empty, by the plan its family declares
(model/hf_plans.py), matched block by block.

A colwise layer splits its output features (each tp rank computes its heads of q, k, v or its
part of the MLP's hidden units) and returns the local part; the rowwise layer after it splits its
input features the same way and sums the outputs over the tp ranks.

The GPT plan, between the two matmul regions of each block, keeps the residual stream split
along the sequence (sequence parallelism): norms, dropout and residual adds run on each rank's
`seq / tp` tokens; the attention and MLP inputs are all-gathered, their outputs reduce-scattered
(the bytes of one all-reduce, but no rank holds the whole stream between blocks). The vocabulary
is split too: the token embedding by rows (each rank looks up its part of the table; the sums
are reduce-scattered into sequence shards, or with learned positions all-reduced and split once
the positions are added), and
`lm_head` column-wise with its logits left split over the vocabulary, so the loss is computed
without any rank holding all the logits (`loss_parallel`, entered by the fsdp backend around the
loss and its backward). A tied `lm_head` shares the embedding's table, split the same way.
Everything after the embedding holds different data on each tp rank, so each rank draws its own
dropout masks (seeded per rank at build).

For `kind=hf` models everything outside the matched layers (embeddings, norms, lm_head) stays
whole on every tp rank; transformers' attention reshapes to `(-1, head_dim)`, so a q/k/v layer
split by heads needs no change; the kv heads must divide by the tp degree. GPT-2's layers are
transformers `Conv1D`s, split by bigtrain's own layer (tensor/conv1d.py), its fused q/k/v by the
`colwise_qkv` style. The declared plans' other styles: `colwise_gather_output` and
`rowwise_split_input` (torch's styles with a replicated output / input), per-head norms whole
with their gradients summed (`replicated_with_grad_allreduce`: torch's sequence-parallel style on
the heads dim) and MLA's shared down-projection (`mla_kv_a_proj`: its rotary part's gradient
summed, `sum_rotary_grad`).
"""

from __future__ import annotations

import fnmatch

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from bigtrain.config.parallel import check_gpt_tensor_parallel
from bigtrain.errors import ConfigError
from bigtrain.model.gpt import GPT
from bigtrain.model.hf_plans import family_plans, require
from bigtrain.parallel.tensor.conv1d import is_conv1d, parallelize_conv1d
from bigtrain.parallel.transforms import transformer_blocks
from bigtrain.precision.int8 import Int8Layer
from bigtrain.utils.seeds import derived_seed

STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def linear_style(module: nn.Module, style: str, **kwargs) -> ParallelStyle:
    """torch's style for a linear layer, or for an FP8 layer of the tensorwise recipe
    torchao's float8 one (its input all-gathered in FP8; precision/fp8.py)."""
    from bigtrain.precision.fp8 import fp8_tp_styles, uses_fp8_tp_styles

    kind = fp8_tp_styles()[style] if uses_fp8_tp_styles(module) else STYLES[style]
    return kind(**kwargs)


GPT_PLAN = {
    "attn.q": "colwise",
    "attn.k": "colwise",
    "attn.v": "colwise",
    "attn.proj": "rowwise",
    "mlp.gate": "colwise",
    "mlp.up": "colwise",
    "mlp.down": "rowwise",
}
"""The layers of a GPT block that tensor parallelism splits (also what `bigtrain plan` counts)."""


def unwrapped(block: nn.Module) -> nn.Module:
    """The block inside an activation-checkpointing wrapper (whose names get a prefix)."""
    return getattr(block, "_checkpoint_wrapped_module", block)


def splittable(module: nn.Module) -> bool:
    """An nn.Linear (torch's styles) or a transformers Conv1D (tp_conv1d)."""
    return isinstance(module, nn.Linear) or is_conv1d(module)


ROWWISE = ("rowwise", "rowwise_split_input")
COLWISE = ("colwise", "colwise_gather_output", "colwise_qkv")
WHOLE = ("replicated_with_grad_allreduce",)
"""Styles of a module that stays whole (a per-head norm): any module with parameters."""


def block_plan(block: nn.Module, patterns: dict[str, str]) -> dict[str, str]:
    """The block's layers that match a pattern, by name -> style (first match wins): Linear and
    Conv1D layers, and for a whole-weight style (a per-head norm) any module with parameters."""
    plan = {}
    for name, module in unwrapped(block).named_modules():
        style = next((s for p, s in patterns.items() if fnmatch.fnmatchcase(name, p)), None)
        if style is None:
            continue
        if isinstance(module, Int8Layer) and not isinstance(module, nn.Linear):
            raise ConfigError(
                f"key 'parallel.tp_plan' matched {name}, a transformers Conv1D converted to INT8 "
                "(precision.int8): tensor parallelism splits INT8 nn.Linear layers only; leave "
                "it out of precision.int8's modules or set parallel.tensor_parallel=1"
            )
        whole = style in WHOLE and any(True for _ in module.parameters(recurse=False))
        if splittable(module) or whole:
            plan[name] = style
    return plan


def check_styles(block: nn.Module, plan: dict[str, str], patterns: dict[str, str]) -> None:
    """Colwise layers and the rowwise ones after them; colwise_qkv only on a Conv1D."""
    layers = dict(unwrapped(block).named_modules())
    fused = [n for n, s in plan.items() if s == "colwise_qkv" and not is_conv1d(layers[n])]
    if fused:
        raise ConfigError(
            f"key 'parallel.tp_plan': colwise_qkv is for a fused q/k/v Conv1D (GPT-2's "
            f"attn.c_attn); {fused} are nn.Linear layers: use colwise"
        )
    styles = set(plan.values())
    if not styles & set(ROWWISE) or not styles & set(COLWISE):
        names = [n for n, m in layers.items() if splittable(m)]
        raise ConfigError(
            f"key 'parallel.tp_plan' ({patterns}) matched {plan or 'no Linear or Conv1D layers'} "
            f"in {type(unwrapped(block)).__name__}; it needs colwise layers and the rowwise "
            f"ones after them (names in a block: {names})"
        )


def uses_gpt_plan(model: nn.Module) -> bool:
    """Whether tensor parallelism splits `model` by bigtrain's GPT plan: its logits come out split
    by vocabulary (the loss runs under loss_parallel) and every tp rank holds other tokens or
    heads past the embedding (so each draws its own dropout masks). Other models keep their
    residual stream whole on every tp rank: their tp ranks share one dropout seed, and since each
    holds the same number of heads, their random draws stay in step."""
    return isinstance(model, GPT)


def dropout_seed(seed: int, rank: int, step: int = 0) -> int:
    """The seed of a rank's own dropout masks under the GPT plan (at start, or when a resume at
    `step` has no RNG state saved for this rank)."""
    return derived_seed("dropout", seed, rank, step)


def check_divisible(model: nn.Module, tp: int) -> None:
    """Heads and kv heads split whole over the tp ranks (transformers' config names)."""
    config = getattr(getattr(model, "hf", None), "config", None)
    for key in ("num_attention_heads", "num_key_value_heads"):
        value = getattr(config, key, None)
        if value is not None and value % tp:
            raise ConfigError(
                f"key 'parallel.tensor_parallel' ({tp}) must divide the model's {key} ({value}): "
                "each tp rank computes whole heads"
            )


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, patterns: dict[str, str]) -> None:
    """Split the model over `tp_mesh` (in place): bigtrain's GPT by its own plan, a transformers
    model by `patterns` (parallel.tp_plan) or, without them, the plan its family declares
    (model/hf_plans.py)."""
    if uses_gpt_plan(model):
        apply_gpt_plan(model, tp_mesh)  # type: ignore[arg-type]
        return
    check_divisible(model, tp_mesh.size())
    if not patterns:
        plans = family_plans(model.hf)  # type: ignore[union-attr]
        require(plans, "parallel.tensor_parallel", tp_mesh.size())
        patterns = plans.tp
    config = model.hf.config  # type: ignore[union-attr]
    for block in transformer_blocks(model):
        block = unwrapped(block)
        plan = block_plan(block, patterns)  # per block: dense and MoE layers differ
        check_styles(block, plan, patterns)
        conv1d = {n: s for n, s in plan.items() if is_conv1d(block.get_submodule(n))}
        for name, style in conv1d.items():
            parallelize_conv1d(block, name, style, tp_mesh)
        linear = {}
        for name, style in plan.items():
            if name in conv1d:
                continue
            module = block.get_submodule(name)
            if style == "mla_kv_a_proj":
                sum_rotary_grad(module, tp_mesh, config.qk_rope_head_dim)
            else:
                linear[name] = hf_style(module, style)
        if linear:
            parallelize_module(block, tp_mesh, linear)


def hf_style(module: nn.Module, style: str) -> ParallelStyle:
    """torch's style (or FP8's) for a declared one (model/hf_plans.py TP_STYLES)."""
    if style == "colwise_gather_output":
        return linear_style(module, "colwise", output_layouts=Replicate())
    if style == "rowwise_split_input":
        return linear_style(module, "rowwise", input_layouts=Replicate())
    if style == "replicated_with_grad_allreduce":
        # a norm over each head's features of (batch, seq, heads, head_dim): its input held as
        # split by heads, its weight whole; the weight's gradient, partial on each tp rank,
        # is summed as DTensor makes it whole (torch's sequence-parallel norms, on dim 2)
        return SequenceParallel(sequence_dim=2, use_local_output=True)
    return linear_style(module, style)


class _SumGrad(torch.autograd.Function):
    """Identity forward; the gradient summed over a process group."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sum_rotary_grad(module: nn.Module, tp_mesh: DeviceMesh, rope_dim: int) -> None:
    """MLA's key/value down-projection (DeepSeek's kv_a_proj_with_mqa), whole on every tp rank:
    its output's last `rope_dim` features are the rotary key every head shares, which goes to
    attention without the split up-projection; each rank's heads give a part of its gradient,
    summed here (the other part's gradient arrives whole through the colwise kv_b_proj)."""
    group = tp_mesh.get_group()

    def hook(_module, _inputs, out: torch.Tensor) -> torch.Tensor:
        keep, rotary = out.split([out.shape[-1] - rope_dim, rope_dim], dim=-1)
        return torch.cat([keep, _SumGrad.apply(rotary, group)], dim=-1)

    module.register_forward_hook(hook)


def apply_gpt_plan(model: GPT, tp_mesh: DeviceMesh) -> None:
    """bigtrain's GPT over `tp_mesh`: colwise q, k, v, gate, up; rowwise proj and down with
    their outputs scattered along the sequence; sequence-parallel norms and dropout; a
    vocabulary-parallel embedding and lm_head (logits stay split: loss parallelism)."""
    check_gpt_tensor_parallel(model.cfg, tp_mesh.size())
    seq = Shard(1)
    for block in transformer_blocks(model):
        present = dict(unwrapped(block).named_modules())  # a GELU MLP has no gate
        layers = {
            name: linear_style(present[name], "colwise")
            if style == "colwise"
            # reduce-scatter into sequence shards
            else linear_style(present[name], "rowwise", output_layouts=seq)
            for name, style in GPT_PLAN.items()
            if name in present
        }
        parallelize_module(
            unwrapped(block),
            tp_mesh,
            {
                "norm1": SequenceParallel(),
                # (x, rope, mask): x is all-gathered for the heads; rope and mask stay as they are
                "attn": PrepareModuleInput(
                    input_layouts=(seq, None, None), desired_input_layouts=(Replicate(), None, None)
                ),
                "norm2": SequenceParallel(),
                "mlp": PrepareModuleInput(
                    input_layouts=(seq,), desired_input_layouts=(Replicate(),)
                ),
                **layers,
            },
        )
    model.hidden_seq_shards = tp_mesh.size()  # a later pipeline stage's input: one shard
    _split_ends(model, tp_mesh, seq)


def _split_ends(model: GPT, tp_mesh: DeviceMesh, seq: Shard) -> None:
    """The embedding, final norm and lm_head over the tp ranks: vocabulary rows split, the
    sequence scattered after the embedding. A pipeline stage holds the ones it runs (the last
    stage of a tied model also holds the table, split alike)."""
    head = model.lm_head if model.gives_logits else None
    tied = head is not None and model.tok_emb is not None and head.weight is model.tok_emb.weight
    plan: dict[str, ParallelStyle] = {}
    if model.tok_emb is not None and model.pos_emb is None:  # reduce-scattered into shards
        plan["tok_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    elif model.tok_emb is not None:  # summed whole, positions added, split at `drop`
        plan["tok_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        plan["drop"] = PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(seq,), use_local_output=True
        )
    if head is not None:
        plan["norm_f"] = SequenceParallel()
        plan["lm_head"] = ColwiseParallel(
            input_layouts=seq, output_layouts=Shard(-1), use_local_output=False
        )
    if plan:
        parallelize_module(model, tp_mesh, plan)
    if tied:  # both split the table by vocabulary rows: one parameter again
        model.lm_head.weight = model.tok_emb.weight
