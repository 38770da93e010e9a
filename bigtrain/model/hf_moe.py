"""The transformers config of bigtrain's MoE GPT: Mixtral (Llama style, every block a mixture of
softmax-routed experts whose top-k weights are renormalised, no shared expert). The tensors'
mapping is hf_mapping.py's (`Part.experts`)."""

from __future__ import annotations

from typing import Any

from bigtrain.config.schema import ModelConfig, default_d_ff
from bigtrain.errors import ConfigError

MIXTRAL_NEEDS = {
    "moe.every": 1,
    "moe.first": 0,
    "moe.shared_experts": 0,
    "moe.score": "softmax",
    "moe.normalize_weights": True,
    "moe.capacity_factor": 0.0,
}
"""The model.moe settings of a Mixtral (besides Llama's), by key."""


def check_mixtral(cfg: ModelConfig) -> None:
    """ConfigError naming each model.moe setting a Mixtral cannot express."""
    wrong = [
        f"model.{key}={value} (have {getattr(cfg.moe, key.split('.')[1])})"
        for key, value in MIXTRAL_NEEDS.items()
        if getattr(cfg.moe, key.split(".")[1]) != value
    ]
    if wrong:
        raise ConfigError(
            "no transformers mapping for this MoE model: MixtralForCausalLM needs "
            + ", ".join(wrong)
        )


def mixtral_config(cfg: ModelConfig, vocab_size: int) -> dict[str, Any]:
    from transformers import MixtralConfig

    check_mixtral(cfg)
    head_dim = cfg.d_model // cfg.n_heads
    return MixtralConfig(
        vocab_size=vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.moe.d_expert or cfg.d_ff or default_d_ff(cfg),
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads or cfg.n_heads,
        head_dim=head_dim,
        hidden_act="silu",
        max_position_embeddings=cfg.seq_len,
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta,
        sliding_window=None,
        num_local_experts=cfg.moe.experts,
        num_experts_per_tok=cfg.moe.top_k,
        router_aux_loss_coef=cfg.moe.aux_loss_coef,
        router_jitter_noise=0.0,
        attention_dropout=0.0,  # the export is for inference
        tie_word_embeddings=cfg.tie_embeddings,
        bos_token_id=None,
        eos_token_id=None,
        architectures=["MixtralForCausalLM"],
        dtype="float32",
    ).to_dict()
