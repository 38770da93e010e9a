import dataclasses

import pytest
import torch

from bigtrain.config.schema import ModelConfig
from bigtrain.errors import ConfigError
from bigtrain.model.gpt import GPT
from bigtrain.model.hf_mapping import mapping_for

pytestmark = pytest.mark.unit

GPT2 = ModelConfig(n_layers=2, n_heads=4, d_model=32, seq_len=16, vocab_size=96)
LLAMA = dataclasses.replace(
    GPT2, position="rope", norm="rmsnorm", mlp="swiglu", bias=False, n_kv_heads=2
)


def shapes_of(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    return {n: tuple(p.shape) for n, p in GPT(cfg).named_parameters()}


@pytest.mark.parametrize(
    "cfg",
    [GPT2, dataclasses.replace(GPT2, bias=False, tie_embeddings=False), LLAMA],
    ids=["gpt2", "gpt2-nobias-untied", "llama-gqa"],
)
def test_split_and_join_are_inverse(cfg):
    torch.manual_seed(0)
    params = dict(GPT(cfg).named_parameters())
    mapping = mapping_for(cfg, {n: tuple(p.shape) for n, p in params.items()})
    assert list(mapping.shapes) == list(mapping.parts)  # read and written in one order
    hf = dict(mapping.split((name, params[name].detach()) for name in mapping.shapes))
    assert list(hf) == [n for n in mapping.hf_shapes() if n not in mapping.extra]  # in order
    assert {n: tuple(t.shape) for n, t in hf.items()} == {
        n: s for n, s in mapping.hf_shapes().items() if n not in mapping.extra
    }
    for name, param in params.items():
        assert torch.equal(mapping.join(name, hf.__getitem__), param)


def test_llama_maps_each_projection_to_its_own_tensor():
    mapping = mapping_for(LLAMA, shapes_of(LLAMA))
    assert [(n, p.hf_name, p.rows) for n, p in mapping.parts.items() if ".0.attn." in n] == [
        ("blocks.0.attn.q.weight", "model.layers.0.self_attn.q_proj.weight", 32),
        ("blocks.0.attn.k.weight", "model.layers.0.self_attn.k_proj.weight", 16),  # 2 heads of 8
        ("blocks.0.attn.v.weight", "model.layers.0.self_attn.v_proj.weight", 16),
        ("blocks.0.attn.proj.weight", "model.layers.0.self_attn.o_proj.weight", 32),
    ]
    assert (
        mapping.parts["blocks.0.mlp.gate.weight"].hf_name == "model.layers.0.mlp.gate_proj.weight"
    )
    assert mapping.parts["blocks.0.mlp.up.weight"].hf_name == "model.layers.0.mlp.up_proj.weight"
    assert all(p.offset == 0 and not p.transpose for p in mapping.parts.values())
    assert "lm_head.weight" not in mapping.parts  # tied: the embedding is written once


def test_gpt2_c_attn_holds_q_k_v_as_column_ranges():
    mapping = mapping_for(GPT2, shapes_of(GPT2))
    rows = [
        (n.rsplit(".", 2)[1], p.offset, p.rows, p.transpose)
        for n, p in mapping.parts.items()
        if p.hf_name == "transformer.h.1.attn.c_attn.weight"
    ]
    assert rows == [("q", 0, 32, True), ("k", 32, 32, True), ("v", 64, 32, True)]
    assert mapping.hf_shapes()["transformer.h.1.attn.c_attn.weight"] == (32, 96)  # (in, out)
    assert mapping.hf_shapes()["transformer.h.1.attn.c_attn.bias"] == (96,)
    assert mapping.parts["blocks.1.attn.v.bias"].offset == 64
    torch.manual_seed(0)
    q, k, v = torch.randn(32, 32), torch.randn(32, 32), torch.randn(32, 32)
    names = [f"blocks.1.attn.{x}.weight" for x in "qkv"]
    ((hf_name, c_attn),) = mapping.split(zip(names, (q, k, v), strict=True))
    assert hf_name == "transformer.h.1.attn.c_attn.weight"
    assert torch.equal(c_attn, torch.cat([q, k, v]).T)  # Conv1D's columns are [q | k | v]


def test_gpt2_conv1d_weights_are_transposed_and_missing_biases_are_zeros():
    cfg = dataclasses.replace(GPT2, bias=False)
    mapping = mapping_for(cfg, shapes_of(cfg))
    assert mapping.parts["blocks.1.mlp.up.weight"].transpose
    assert mapping.hf_shapes()["transformer.h.1.mlp.c_fc.weight"] == (32, 128)  # (in, out)
    assert not mapping.parts["blocks.1.norm1.weight"].transpose
    assert mapping.extra["transformer.h.1.attn.c_attn.bias"] == (96,)
    assert len(mapping.extra) == 2 * 6 + 1  # six per block and ln_f


def test_llama_config_carries_gqa_rope_and_norm_settings():
    cfg = dataclasses.replace(LLAMA, rope_theta=500000.0, norm_eps=1e-6, d_ff=80)
    config = mapping_for(cfg, shapes_of(cfg)).config
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "float32"
    assert config["num_key_value_heads"] == 2 and config["num_attention_heads"] == 4
    assert config["head_dim"] == 8 and config["intermediate_size"] == 80
    assert config["rope_parameters"]["rope_theta"] == 500000.0
    assert config["rms_norm_eps"] == 1e-6 and config["max_position_embeddings"] == 16
    assert config["attention_bias"] is False and config["mlp_bias"] is False


def test_gpt2_config_is_for_inference_with_tanh_gelu():
    cfg = dataclasses.replace(GPT2, dropout=0.1, norm_eps=1e-6)
    config = mapping_for(cfg, shapes_of(cfg)).config
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["dtype"] == "float32"
    assert config["activation_function"] == "gelu_new" and config["n_inner"] == 128
    assert config["layer_norm_epsilon"] == 1e-6 and config["n_positions"] == 16
    assert config["resid_pdrop"] == config["embd_pdrop"] == config["attn_pdrop"] == 0.0
    assert config["bos_token_id"] is None and config["eos_token_id"] is None  # the export's job


def test_unmappable_config_names_the_keys_and_both_layouts():
    cfg = dataclasses.replace(GPT2, position="rope")
    with pytest.raises(ConfigError) as info:
        mapping_for(cfg, shapes_of(cfg))
    message = str(info.value)
    assert "GPT2LMHeadModel needs model.position=learned (have rope)" in message
    assert "LlamaForCausalLM needs model.norm=rmsnorm (have layernorm)" in message
    assert "model.mlp=swiglu (have gelu)" in message
    gqa = dataclasses.replace(GPT2, n_kv_heads=2)
    with pytest.raises(ConfigError, match="model.n_kv_heads=null or n_heads \\(have 2\\)"):
        mapping_for(gqa, shapes_of(gqa))


def test_tensors_of_another_model_config_are_refused():
    shapes = shapes_of(LLAMA)
    with pytest.raises(ConfigError, match="blocks.0.mlp.gate.weight"):
        mapping_for(dataclasses.replace(LLAMA, d_ff=64), shapes)
    learned = dataclasses.replace(LLAMA, position="learned", norm="layernorm", mlp="gelu")
    with pytest.raises(ConfigError, match="missing \\['pos_emb.weight'\\]"):
        mapping_for(dataclasses.replace(learned, n_kv_heads=None), shapes)
    with pytest.raises(
        ConfigError, match="read with shape \\(96, 16\\), the mapping was made for \\(96, 32\\)"
    ):
        next(mapping_for(LLAMA, shapes).split([("tok_emb.weight", torch.zeros(96, 16))]))


@pytest.mark.parametrize(
    ("built", "found", "hint"),
    [(LLAMA, GPT2, "model.position=learned"), (GPT2, LLAMA, "model.position=rope")],
    ids=["gpt2-dir-for-llama", "llama-dir-for-gpt2"],
)
def test_a_config_of_the_other_model_type_is_named_not_a_key_error(built, found, hint):
    from bigtrain.model.hf_check import check_hf_config

    mapping = mapping_for(built, shapes_of(built))
    theirs = mapping_for(found, shapes_of(found))
    with pytest.raises(ConfigError) as e:
        check_hf_config(mapping, theirs.config, "directory 'x'")
    message = str(e.value)
    assert (
        f"holds a {theirs.architecture}" in message
        and f"builds a {mapping.architecture}" in message
    )
    assert hint in message and "model.kind=hf" in message
