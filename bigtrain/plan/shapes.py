"""The planned model without building it: on the meta device (shapes only, no storage), its
parameter count, its largest block, and the shape activation memory depends on."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bigtrain.config.data import DataConfig
from bigtrain.config.schema import ModelConfig
from bigtrain.data.read.prepared import PreparedData
from bigtrain.model import build_model, num_params
from bigtrain.model.routed import routed_experts
from bigtrain.parallel.transforms import transformer_blocks


def vocab_size_for_plan(model: ModelConfig, data: DataConfig) -> int:
    if model.vocab_size:
        return model.vocab_size
    if data.source == "prepared":  # every source has the first one's tokenizer
        return PreparedData.open(data.mixture[0].path, verify=False).vocab_size
    if data.tokenizer == "bpe":
        return data.vocab_size
    from bigtrain.data.prepare.cache import load_tokenizer

    return len(load_tokenizer(data.tokenizer))


def meta_model(model: ModelConfig, data: DataConfig) -> torch.nn.Module:
    """The model on the meta device: shapes only, no storage."""
    with torch.device("meta"):
        return build_model(model, vocab_size_for_plan(model, data))


def gathered_block_params(model: torch.nn.Module, ep: int = 1) -> list[float]:
    """Each transformer block's parameters as one rank gathers it: under expert parallelism `ep`
    an MoE block's routed experts are gathered over its rank's 1/ep of them."""

    routed = {id(r.module): r.params for r in routed_experts(model)}

    def gathered(block: torch.nn.Module) -> float:
        experts = sum(routed.get(id(m), 0) for m in block.modules())
        return num_params(block) - experts + experts / ep

    return [gathered(b) for b in transformer_blocks(model)]


def count_params(model: torch.nn.Module, ep: int = 1) -> tuple[int, int]:
    """(parameters, largest transformer block's parameters as one rank gathers it) of a
    meta-device model (gathered_block_params)."""
    return num_params(model), int(max(gathered_block_params(model, ep)))


@dataclass(frozen=True)
class Shape:
    """What activation memory depends on (bigtrain's GPT; transformers models by their config)."""

    n_layers: int
    d_model: int
    d_ff: int
    kv_width: int  # width of K (= of V): n_kv_heads x head_dim
    n_heads: int
    seq_len: int
    vocab_size: int
    swiglu: bool
    rmsnorm: bool


def model_shape(m: ModelConfig, data: DataConfig) -> Shape:
    from bigtrain.model.gpt import default_d_ff

    if m.kind == "hf":
        with torch.device("meta"):
            hf = build_model(m, vocab_size_for_plan(m, data)).hf.config  # type: ignore[union-attr]
        d = getattr(hf, "hidden_size", getattr(hf, "n_embd", 0))
        heads = getattr(hf, "num_attention_heads", getattr(hf, "n_head", 1))
        kv = getattr(hf, "num_key_value_heads", None) or heads
        ff = getattr(hf, "intermediate_size", None) or getattr(hf, "n_inner", None) or 4 * d
        swiglu = getattr(hf, "hidden_act", "") == "silu"
        rms = getattr(hf, "rms_norm_eps", None) is not None
        layers = getattr(hf, "num_hidden_layers", getattr(hf, "n_layer", 0))
        return Shape(layers, d, ff, kv * d // heads, heads, m.seq_len, hf.vocab_size, swiglu, rms)
    kv = (m.n_kv_heads or m.n_heads) * (m.d_model // m.n_heads)
    d_ff = m.d_ff or default_d_ff(m)
    if m.moe.experts:  # a token's MoE hidden units: top_k routed and the shared experts' (at most)
        d_ff = max(d_ff, (m.moe.top_k + m.moe.shared_experts) * (m.moe.d_expert or d_ff))
    return Shape(
        m.n_layers,
        m.d_model,
        d_ff,
        kv,
        m.n_heads,
        m.seq_len,
        vocab_size_for_plan(m, data),
        m.mlp == "swiglu",
        m.norm == "rmsnorm",
    )
