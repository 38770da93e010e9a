"""Model transforms applied from outside the model file: activation checkpointing and compile.
Used by every backend, before it shards or wraps the model."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

# Selective checkpointing keeps what is expensive to recompute (matmuls, attention) and recomputes
# the rest (norms, activations, residual adds, casts): most of the memory for a small share of the
# FLOPs (Korthikanti et al. 2022).
_aten = torch.ops.aten
SAVED_OPS = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten._int_mm.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def block_container(model: nn.Module) -> nn.ModuleList | nn.ModuleDict:
    """The model's container of transformer blocks: the largest ModuleList of same-type modules
    (`blocks` in bigtrain's GPT, `transformer.h` in GPT-2, `model.layers` in Llama), or the
    ModuleDict a pipeline stage keeps its blocks in (parallel/pipeline/split.py)."""
    candidates = [
        m
        for m in model.modules()
        if isinstance(m, nn.ModuleList | nn.ModuleDict)
        and len(m)
        and len({type(b) for b in m.children()}) == 1
        and not isinstance(next(iter(m.children())), nn.ModuleList | nn.ModuleDict)
    ]
    best = max(candidates, key=len, default=None)
    assert best is not None, f"no transformer blocks found in {type(model).__name__}"
    return best


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's transformer blocks in order (block_container's)."""
    return list(block_container(model).children())


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """`block`: recompute each block's activations in backward instead of keeping them.
    `selective`: recompute only the cheap ops of each block, keep the matmul and attention
    outputs."""
    if mode == "none":
        return
    kwargs = {}
    if mode == "selective":
        kwargs["context_fn"] = partial(create_selective_checkpoint_contexts, _save_matmuls)
    blocks = block_container(model)
    for key, block in list(blocks.named_children()):
        wrapped = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **kwargs)
        blocks.register_module(key, wrapped)


def apply_compile(model: nn.Module) -> None:
    """torch.compile each block in place (parameter names unchanged)."""
    for block in transformer_blocks(model):
        block.compile()
