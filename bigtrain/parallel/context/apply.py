"""Context parallelism applied to a built model: the step of parallelize() after tensor
parallelism (parallel/parallelize.py)."""

from __future__ import annotations

import torch

from bigtrain.model.gpt import GPT, CausalSelfAttention
from bigtrain.model.hf import HFCausalLM
from bigtrain.model.moe import MoE
from bigtrain.parallel.context import hf
from bigtrain.parallel.context.attention import ContextAttention
from bigtrain.parallel.context.split import ContextSplit


def apply_context_parallel(model: torch.nn.Module, split: ContextSplit) -> None:
    """Point bigtrain's GPT and each of its attention layers at the cp ranks: the model keeps
    its chunks of each sequence, the attention crosses the ranks, and each MoE layer's
    load-balancing loss counts the loads of the whole sequences."""
    if isinstance(model, HFCausalLM):  # through transformers' attention registry
        hf.apply(model, split)
        return
    assert isinstance(model, GPT), "config/parallel.py's check_context allows GPT and HF only"
    model.context = split
    for module in model.modules():
        if isinstance(module, CausalSelfAttention):
            module.context = ContextAttention(split)
        elif isinstance(module, MoE):  # its load-balancing loss counts the whole sequences
            module.sequence = (split.group, split.degree)
