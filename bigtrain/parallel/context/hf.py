"""Context parallelism for transformers' Llama-family models, through transformers' own
attention-function registry: each attention layer calls bigtrain's ring or all-to-all in place
of SDPA, and the model is fed this rank's chunks with their true position ids (model/hf.py).

The families are those whose attention is plain causal attention over all positions, called
through `ALL_ATTENTION_FUNCTIONS` with rotary positions from `position_ids`: llama, mistral,
qwen2 and qwen3, without a sliding window. Others (sliding windows, soft-capped logits, MLA,
GPT-2's Conv1D attention) exit 2 naming the family.
"""

from __future__ import annotations

from typing import Any

import torch

from bigtrain.errors import ConfigError
from bigtrain.model.hf import HFCausalLM
from bigtrain.parallel.context.attention import ContextAttention
from bigtrain.parallel.context.split import ContextSplit

ATTENTION = "bigtrain_context"
"""The name bigtrain's attention is registered under in transformers."""
HF_TYPES = ("llama", "mistral", "qwen2", "qwen3")
"""transformers model types whose attention context parallelism replaces (config/parallel.py
checks model.hf_config's type; `apply` checks the built model's)."""


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,  # noqa: ARG001 (the cp kernels mask themselves)
    dropout: float = 0.0,  # noqa: ARG001 (checked to be 0 at build)
    scaling: float | None = None,
    **kwargs: Any,  # noqa: ARG001
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: q (batch, heads, chunk, dim), k and v (batch, kv
    heads, chunk, dim) of this rank's chunks -> (batch, chunk, heads, dim), no weights."""
    out = module.bigtrain_context(query, key, value, None, scaling)
    return out.transpose(1, 2).contiguous(), None


def no_mask(*args: Any, **kwargs: Any) -> None:  # noqa: ARG001
    """transformers' mask interface: no mask (the ring's blocks and the all-to-all's attention
    are causal by themselves, over the whole sequence's positions)."""
    return None


def apply(model: HFCausalLM, split: ContextSplit) -> None:
    """Register bigtrain's attention with transformers and point `model` at it; ConfigError
    naming the family where its attention is not plain causal attention."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    config = model.hf.config
    model_type = config.model_type
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", window is not None) is False:
        window = None
    if model_type not in HF_TYPES or window is not None:
        why = f"a sliding window of {window}" if window is not None else "not a supported family"
        raise ConfigError(
            f"key 'parallel.context_parallel': model.kind=hf with model_type {model_type!r} "
            f"({why}) is not split by sequence (supported: {', '.join(HF_TYPES)} without a "
            "sliding window)"
        )
    if getattr(config, "attention_dropout", 0.0):
        raise ConfigError(
            f"key 'parallel.context_parallel': the model's attention_dropout "
            f"({config.attention_dropout}) must be 0: the cp attention kernels run without dropout"
        )
    heads = config.num_attention_heads
    if split.style == "all_to_all" and heads % split.degree:
        raise ConfigError(
            f"key 'parallel.context_parallel' ({split.degree}) must divide the model's "
            f"{heads} attention heads with parallel.cp_style=all_to_all; use cp_style=ring"
        )
    AttentionInterface.register(ATTENTION, attention)
    AttentionMaskInterface.register(ATTENTION, no_mask)
    config._attn_implementation = ATTENTION
    for layer in model.hf.model.layers:
        layer.self_attn.bigtrain_context = ContextAttention(split)
    model.context = split
