import pytest

from bigtrain.model.fused import fused_rows, is_fused, unfused_shapes

pytestmark = pytest.mark.unit

# d_model 32, 2 key/value heads of 8 (GQA), SwiGLU hidden 48: the shapes of before the split
SWIGLU = {
    "tok_emb.weight": (96, 32),
    "blocks.0.attn.qkv.weight": (64, 32),
    "blocks.0.attn.qkv.bias": (64,),
    "blocks.0.attn.proj.weight": (32, 32),
    "blocks.0.mlp.up.weight": (96, 32),
    "blocks.0.mlp.up.bias": (96,),
    "blocks.0.mlp.down.weight": (32, 48),
}


def test_qkv_splits_by_d_model_and_swiglu_up_into_gate_and_up():
    rows = fused_rows(SWIGLU)
    assert rows["blocks.0.attn.q.weight"] == ("blocks.0.attn.qkv.weight", 0, 32)
    assert rows["blocks.0.attn.k.weight"] == ("blocks.0.attn.qkv.weight", 32, 16)
    assert rows["blocks.0.attn.v.bias"] == ("blocks.0.attn.qkv.bias", 48, 16)
    assert rows["blocks.0.mlp.gate.weight"] == ("blocks.0.mlp.up.weight", 0, 48)
    assert rows["blocks.0.mlp.up.bias"] == ("blocks.0.mlp.up.bias", 48, 48)
    assert list(unfused_shapes(SWIGLU).items()) == [
        ("tok_emb.weight", (96, 32)),
        ("blocks.0.attn.q.weight", (32, 32)),
        ("blocks.0.attn.k.weight", (16, 32)),
        ("blocks.0.attn.v.weight", (16, 32)),
        ("blocks.0.attn.q.bias", (32,)),
        ("blocks.0.attn.k.bias", (16,)),
        ("blocks.0.attn.v.bias", (16,)),
        ("blocks.0.attn.proj.weight", (32, 32)),
        ("blocks.0.mlp.gate.weight", (48, 32)),
        ("blocks.0.mlp.up.weight", (48, 32)),
        ("blocks.0.mlp.gate.bias", (48,)),
        ("blocks.0.mlp.up.bias", (48,)),
        ("blocks.0.mlp.down.weight", (32, 48)),
    ]


def test_a_gelu_up_and_todays_names_stay_as_they_are():
    gelu = {**SWIGLU, "blocks.0.mlp.up.weight": (48, 32), "blocks.0.mlp.up.bias": (48,)}
    assert not any(".mlp." in n for n in fused_rows(gelu))
    today = {**unfused_shapes(SWIGLU), "hf.model.layers.0.attn.qkv.weight": (3, 3)}
    assert not is_fused(today) and fused_rows(today) == {}
    assert unfused_shapes({"w": [2, 3]}) == {"w": (2, 3)}  # manifests hold lists
    assert is_fused(SWIGLU)


def test_an_int8_calibration_from_before_the_split_serves_todays_layers():
    from bigtrain.model.fused import unfused_calibration

    old = {"blocks.0.attn.qkv": [1.0, 2.0], "blocks.0.mlp.up": [3.0], "blocks.0.mlp.down": [4.0]}
    layers = ["blocks.0.attn.q", "blocks.0.attn.k", "blocks.0.attn.v", "blocks.0.mlp.gate"]
    layers += ["blocks.0.mlp.up", "blocks.0.mlp.down"]
    assert unfused_calibration(old, layers) == {
        "blocks.0.attn.q": [1.0, 2.0],  # q, k and v read the fused layer's input
        "blocks.0.attn.k": [1.0, 2.0],
        "blocks.0.attn.v": [1.0, 2.0],
        "blocks.0.mlp.gate": [3.0],  # so do gate and up
        "blocks.0.mlp.up": [3.0],
        "blocks.0.mlp.down": [4.0],
    }
    today = {"blocks.0.attn.q": [1.0]}
    assert unfused_calibration(today, layers) is today
