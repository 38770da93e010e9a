"""Micro model settings (config overrides) shared by test modules."""

HF_LLAMA = (
    "model.hf_config={model_type: llama, hidden_size: 64, intermediate_size: 128, "
    "num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, "
    "max_position_embeddings: 32}"
)
"""A 2-block transformers Llama (model.kind=hf): 4 heads sharing 2 key/value heads."""

HF_LLAMA_TP_PLAN = (
    "parallel.tp_plan={'self_attn.[qkv]_proj': colwise, self_attn.o_proj: rowwise, "
    "mlp.gate_proj: colwise, mlp.up_proj: colwise, mlp.down_proj: rowwise}"
)
"""Its tensor-parallel plan by transformers' layer names."""

GPT_LLAMA_STYLE = (
    "model.position=rope",
    "model.norm=rmsnorm",
    "model.mlp=swiglu",
    "model.bias=false",
    "model.n_heads=4",
    "model.n_kv_heads=2",
)
"""bigtrain's GPT in the Llama style, with grouped-query attention (4 heads, 2 kv heads)."""
