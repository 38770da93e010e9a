"""The plans each transformers family declares, as bigtrain reads them (model/hf_plans.py), and
its pipeline stages in one process: cut in two, run one after the other, they give the whole
model's logits (FP32, 1e-5)."""

from __future__ import annotations

import pytest
import torch

from bigtrain.config.parallel import TP_STYLES
from bigtrain.errors import ConfigError
from bigtrain.model.gpt import num_params
from bigtrain.model.hf import HFCausalLM, build_hf
from bigtrain.model.hf_plans import family_plans, require
from bigtrain.model.routed import routed_experts
from bigtrain.parallel.pipeline.split import stage_module
from bigtrain.plan.experts import count_experts
from tests.hf_families import FAMILIES, MOE, tiny_config

pytestmark = pytest.mark.unit


def build(model_type: str) -> HFCausalLM:
    torch.manual_seed(0)
    return build_hf(tiny_config(model_type), None, None)


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_each_family_declares_plans_bigtrain_runs(model_type):
    plans = family_plans(build(model_type).hf)
    assert plans.tp and set(plans.tp.values()) <= set(TP_STYLES), plans.tp
    require(plans, "parallel.tensor_parallel", 2)
    assert bool(plans.ep) == (model_type in MOE)
    if model_type in MOE:
        assert plans.ep["mlp.experts"] == "ep_dispatch_experts"
        require(plans, "parallel.expert_parallel", 2)
    else:
        with pytest.raises(ConfigError, match=f"'{model_type}' declares no base_model_ep_plan"):
            require(plans, "parallel.expert_parallel", 2)
    if model_type == "olmoe":  # OLMoE declares no pipeline plan: named, exit 2
        with pytest.raises(ConfigError, match="'olmoe' declares no base_model_pp_plan"):
            require(plans, "parallel.pipeline_parallel", 2)
    else:
        assert plans.stages == (
            "hf.model.layers",
            ("hf.model.embed_tokens",),
            ("hf.model.norm", "hf.lm_head"),
        )


def test_a_family_without_plans_is_named_with_the_layout():
    plans = family_plans(build_hf({"model_type": "opt", **SMALL_OPT}, None, None).hf)
    for key in ("parallel.tensor_parallel", "parallel.pipeline_parallel"):
        with pytest.raises(ConfigError, match=rf"key '{key}' \(2\): .*family 'opt' declares no"):
            require(plans, key, 2)
    gpt2 = family_plans(build_hf({"model_type": "gpt2", "n_layer": 2}, None, None).hf)
    assert gpt2.own and gpt2.tp["attn.c_attn"] == "colwise_qkv" and gpt2.stages


SMALL_OPT = {
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "ffn_dim": 64,
    "word_embed_proj_dim": 32,
    "vocab_size": 384,
}


@pytest.mark.parametrize("model_type", [f for f in FAMILIES if f != "olmoe"])
def test_two_stages_in_one_process_give_the_whole_models_logits(model_type):
    model = build(model_type)
    ids = torch.randint(3, 384, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole = model(ids)
        assert torch.equal(whole, model.hf(input_ids=ids, use_cache=False).logits)
        first = stage_module(model, 0, 1, first=True, last=False)
        last = stage_module(model, 1, 2, first=False, last=True)
        logits = last(first(ids))
    torch.testing.assert_close(logits, whole, rtol=1e-5, atol=1e-5)
    names = {n for n, _ in model.named_parameters()}
    staged = [n for s in (first, last) for n, _ in s.named_parameters()]
    tied = model.hf.config.tie_word_embeddings
    assert set(staged) == names and len(staged) == len(names) + tied


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_active_parameters_are_those_one_token_trains(model_type):
    """The count the planner and the FLOPs per token use (model/routed.py, from the declared ep
    plan) against a measurement: one token's backward gives a gradient to every parameter but
    the routed experts it was not sent to (top k of each MoE layer's)."""
    model = build(model_type)
    total = sum(p.numel() for p in model.parameters())
    count = count_experts(model)
    assert (count is not None) == (model_type in MOE)
    model(torch.tensor([[5]])).sum().backward()
    trained = 0
    stacked = {id(r.module.get_parameter(w)) for r in routed_experts(model) for w in r.weights}
    for p in model.parameters():
        if id(p) in stacked:  # count the experts whose slice got a gradient
            trained += sum(g.numel() for g in p.grad if g.any())
        else:
            trained += p.numel()
    assert num_params(model, active=True) == trained
    if count is not None:
        assert (count.total, count.active) == (total, trained)
        assert count.top_k == 2 and count.routed == 4
