"""Mixtral, the transformers MoE model bigtrain's MoE GPT maps onto: a Mixtral made here from a
config (no download) read into bigtrain's GPT computes the same logits, exports back with the
check passing, and MoE settings Mixtral cannot express are named."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bigtrain.checkpoint.hf_export import check_export, export_hf
from bigtrain.checkpoint.sources import HFSource
from bigtrain.config.model import MoEConfig
from bigtrain.errors import ConfigError
from bigtrain.model.gpt import GPT
from bigtrain.model.hf_check import check_hf_config
from bigtrain.model.hf_mapping import mapping_for
from tests.model.test_hf_mapping import LLAMA, shapes_of

pytestmark = pytest.mark.unit

MOE = dataclasses.replace(
    LLAMA, tie_embeddings=False, moe=MoEConfig(experts=4, top_k=2, d_expert=24)
)


@pytest.fixture
def mixtral_dir(tmp_path):
    """A random Mixtral of MOE's shapes, saved by transformers (the Hub's per-expert layout)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=16,
        sliding_window=None,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    model = MixtralForCausalLM(config).eval()
    model.save_pretrained(tmp_path / "mixtral")
    return tmp_path / "mixtral", model


def test_a_mixtral_reads_into_the_moe_gpt_with_the_same_logits_and_exports_back(
    mixtral_dir, tmp_path
):
    path, theirs = mixtral_dir
    mapping = mapping_for(MOE, shapes_of(MOE))
    found = theirs.config.to_dict()
    check_hf_config(mapping, found, "dir")
    source = HFSource(path, mapping.parts)
    ours = GPT(MOE).eval()
    source.check_covers({n: tuple(p.shape) for n, p in ours.named_parameters()})
    with torch.no_grad():
        for name, p in ours.named_parameters():
            p.copy_(source.full(name))
    idx = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (ours(idx) - theirs(idx).logits).abs().max().item()
    assert diff < 1e-5
    export_hf(mapping, dict(ours.named_parameters()).__getitem__, tmp_path / "back", None)
    result = check_export(ours, tmp_path / "back", 96, 16)
    assert result["ok"] and result["missing_keys"] == [] and result["max_rel_diff"] < 1e-4
    # The experts of one layer come out as the Hub's w1 (gate), w2 (down), w3 (up) per expert.
    names = set(mapping.hf_shapes())
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in names
    assert mapping.hf_shapes()["model.layers.0.block_sparse_moe.experts.0.w1.weight"] == (24, 32)


def test_a_mixtral_of_other_expert_counts_is_refused_naming_the_key(mixtral_dir):
    _, theirs = mixtral_dir
    other = dataclasses.replace(MOE, moe=MoEConfig(experts=8, top_k=2, d_expert=24))
    mapping = mapping_for(other, shapes_of(other))
    with pytest.raises(
        ConfigError, match=r"num_local_experts 4 there, 8 here \(model.moe.experts\)"
    ):
        check_hf_config(mapping, theirs.config.to_dict(), "dir")


@pytest.mark.parametrize(
    ("moe", "named"),
    [
        ({"shared_experts": 1}, "model.moe.shared_experts=0"),
        ({"every": 2}, "model.moe.every=1"),
        ({"first": 1}, r"no dense block .*model.moe.first=0 \(have 1\)"),
        ({"score": "sigmoid"}, "model.moe.score=softmax"),
    ],
)
def test_moe_settings_mixtral_cannot_express_are_named(moe, named):
    cfg = dataclasses.replace(MOE, moe=MoEConfig(experts=4, top_k=2, **moe))
    with pytest.raises(ConfigError, match=named):
        mapping_for(cfg, shapes_of(cfg))
