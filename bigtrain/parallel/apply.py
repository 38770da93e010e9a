"""Model transforms applied from outside the model file: activation checkpointing and compile.
Used by every backend, before it shards or wraps the model."""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)


def transformer_blocks(model: nn.Module) -> nn.ModuleList:
    """The model's list of transformer blocks: the largest ModuleList of same-type modules
    (`blocks` in bigtrain's GPT, `transformer.h` in GPT-2, `model.layers` in Llama)."""
    candidates = [
        m
        for m in model.modules()
        if isinstance(m, nn.ModuleList) and len(m) and len({type(b) for b in m}) == 1
    ]
    best = max(candidates, key=len, default=None)
    assert best is not None, f"no transformer blocks found in {type(model).__name__}"
    return best


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """`block`: recompute each block's activations in backward instead of keeping them."""
    if mode == "none":
        return
    blocks = transformer_blocks(model)
    for i, block in enumerate(blocks):
        blocks[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)


def apply_compile(model: nn.Module) -> None:
    """torch.compile each block in place (parameter names unchanged)."""
    for block in transformer_blocks(model):
        block.compile()
