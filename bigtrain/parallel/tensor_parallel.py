"""Tensor parallelism from outside the model: `parallelize_module` over the mesh's tp axis.

bigtrain's GPT has a plan of its own (`apply_gpt_plan`, Megatron-style with sequence and loss
parallelism); a `model.kind=hf` model is split by `parallel.tp_plan` (module name patterns inside
a transformer block -> colwise/rowwise).

A colwise layer splits its output features (each tp rank computes its heads of q, k, v or its
part of the MLP's hidden units) and returns the local part; the rowwise layer after it splits its
input features the same way and sums the outputs over the tp ranks.

The GPT plan, between the two matmul regions of each block, keeps the residual stream split
along the sequence (sequence parallelism): norms, dropout and residual adds run on each rank's
`seq / tp` tokens; the attention and MLP inputs are all-gathered, their outputs reduce-scattered
(the bytes of one all-reduce, but no rank holds the whole stream between blocks). The vocabulary
is split too: the token embedding by rows (each rank looks up its part of the table), and
`lm_head` column-wise with its logits left split over the vocabulary, so the loss is computed
without any rank holding all the logits (`loss_parallel`, entered by the fsdp backend around the
loss and its backward). A tied `lm_head` shares the embedding's table, split the same way.
Everything after the embedding holds different data on each tp rank, so each rank draws its own
dropout masks (seeded per rank at build).

For `kind=hf` models everything outside the matched layers (embeddings, norms, lm_head) stays
whole on every tp rank; transformers' attention reshapes to `(-1, head_dim)`, so a q/k/v layer
split by heads needs no change; the kv heads must divide by the tp degree.
"""

from __future__ import annotations

import fnmatch

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from bigtrain.config.mesh import check_gpt_tensor_parallel
from bigtrain.errors import ConfigError
from bigtrain.model.gpt import GPT
from bigtrain.parallel.apply import transformer_blocks

STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}

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


def block_plan(block: nn.Module, patterns: dict[str, str]) -> dict[str, str]:
    """The block's Linear layers that match a pattern, by name -> style (first match wins)."""
    plan = {}
    for name, module in unwrapped(block).named_modules():
        style = next((s for p, s in patterns.items() if fnmatch.fnmatchcase(name, p)), None)
        if style is not None and isinstance(module, nn.Linear):
            plan[name] = style
    return plan


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
    """Split the model over `tp_mesh` (in place): bigtrain's GPT by its own plan, another model
    by `patterns` (parallel.tp_plan)."""
    if isinstance(model, GPT):
        apply_gpt_plan(model, tp_mesh)
        return
    check_divisible(model, tp_mesh.size())
    blocks = transformer_blocks(model)
    plan = block_plan(blocks[0], patterns)
    styles = set(plan.values())
    if styles != {"colwise", "rowwise"}:
        names = [n for n, m in unwrapped(blocks[0]).named_modules() if isinstance(m, nn.Linear)]
        raise ConfigError(
            f"key 'parallel.tp_plan' ({patterns}) matched {plan or 'no Linear layers'} in "
            f"{type(blocks[0]).__name__}; it needs colwise layers and the rowwise ones after them "
            f"(names in a block: {names})"
        )
    for block in blocks:
        parallelize_module(unwrapped(block), tp_mesh, {n: STYLES[s]() for n, s in plan.items()})


def apply_gpt_plan(model: GPT, tp_mesh: DeviceMesh) -> None:
    """bigtrain's GPT over `tp_mesh`: colwise q, k, v, gate, up; rowwise proj and down with
    their outputs scattered along the sequence; sequence-parallel norms and dropout; a
    vocabulary-parallel embedding and lm_head (logits stay split: loss parallelism)."""
    check_gpt_tensor_parallel(model.cfg, tp_mesh.size())
    seq = Shard(1)
    for block in model.blocks:
        present = dict(unwrapped(block).named_modules())  # a GELU MLP has no gate
        layers = {
            name: ColwiseParallel()
            if style == "colwise"
            else RowwiseParallel(output_layouts=seq)  # reduce-scatter into sequence shards
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
    tied = model.lm_head.weight is model.tok_emb.weight
    parallelize_module(
        model,
        tp_mesh,
        {
            # vocabulary rows split; the looked-up vectors summed over the tp ranks
            "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            # the whole stream (embedding, learned positions) splits into sequence shards here
            "drop": PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=(seq,), use_local_output=True
            ),
            "norm_f": SequenceParallel(),
            "lm_head": ColwiseParallel(
                input_layouts=seq, output_layouts=Shard(-1), use_local_output=False
            ),
        },
    )
    if tied:  # both split the table by vocabulary rows: one parameter again
        model.lm_head.weight = model.tok_emb.weight
