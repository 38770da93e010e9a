"""Tiny configs of the transformers families bigtrain trains by their declared plans (issue 53),
built here from each family's own config class: no download. Shared by the tests and
bench/families.py.

Every family gets the same small widths (vocabulary 384, d_model 64, 2 layers, 4 heads, 2 key/
value heads), plus what its architecture needs to be small and exercise its parts: a sliding
window layer for Gemma 3, four experts (two per token) for the MoE families, DeepSeek-V3's first
layer dense and its second MoE with a shared expert, and its MLA attention."""

from __future__ import annotations

from typing import Any

COMMON: dict[str, Any] = {
    "vocab_size": 384,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen3": {"head_dim": 16},
    "gemma3_text": {
        "head_dim": 16,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    "olmo2": {},
    "phi3": {},
    "qwen3_moe": {
        "head_dim": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "decoder_sparse_step": 1,
    },
    "deepseek_v3": {
        "num_key_value_heads": 4,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "kv_lora_rank": 16,
        "q_lora_rank": None,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 16,
        "n_group": 1,
        "topk_group": 1,
    },
    "olmoe": {"num_experts": 4, "num_experts_per_tok": 2},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
}
"""model_type -> what its tiny config sets beyond COMMON."""

MOE = ("qwen3_moe", "deepseek_v3", "olmoe", "mixtral")


def tiny_config(model_type: str) -> dict[str, Any]:
    """The family's tiny config as model.hf_config takes it (with model_type)."""
    return {"model_type": model_type, **COMMON, **FAMILIES[model_type]}


def hf_config_override(model_type: str) -> str:
    """`model.hf_config={...}` for a config override list (OmegaConf's flow style)."""

    def flow(value: Any) -> str:
        if isinstance(value, list):
            return "[" + ", ".join(flow(v) for v in value) + "]"
        return "null" if value is None else str(value)

    items = ", ".join(f"{k}: {flow(v)}" for k, v in tiny_config(model_type).items())
    return "model.hf_config={" + items + "}"
