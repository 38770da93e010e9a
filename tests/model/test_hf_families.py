"""The plans each transformers family declares, as bigtrain reads them (model/hf_plans.py), and
its pipeline stages in one process: cut in two, run one after the other, they give the whole
model's logits (FP32, 1e-5)."""

from __future__ import annotations

import pytest
import torch

from bigtrain.config import load_config
from bigtrain.config.parallel import TP_STYLES
from bigtrain.config.schema import Fp8Config, Int8Config
from bigtrain.errors import ConfigError
from bigtrain.model.gpt import num_params
from bigtrain.model.hf import HFCausalLM, build_hf
from bigtrain.model.hf_plans import family_plans, require
from bigtrain.model.hf_routers import router_modules
from bigtrain.model.moe import aux_grad_scale
from bigtrain.model.routed import routed_experts
from bigtrain.monitor.routers import router_layers, router_weight
from bigtrain.parallel.pipeline.split import stage_module
from bigtrain.plan.experts import count_experts
from bigtrain.plan.shapes import count_params, meta_model
from bigtrain.precision.fp8 import select_fp8_layers
from bigtrain.precision.int8 import convert_to_int8
from bigtrain.precision.islands import FP32Islands
from tests.hf_families import FAMILIES, MOE, hf_config_override, tiny_config

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
    the routed experts it was not sent to (top k of each MoE layer's). The planner's own build
    of the config (on the meta device) counts the same."""
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
    # `bigtrain plan` builds the model of the config on the meta device: the same counts
    cfg = load_config([], ["model.kind=hf", hf_config_override(model_type), "model.vocab_size=384"])
    planned = meta_model(cfg.model, cfg.data)
    assert count_params(planned)[0] == total
    assert num_params(planned, active=True) == trained


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_the_familys_load_balancing_loss_trains_as_transformers_adds_it(model_type):
    """With output_router_logits (the family's switch), a training forward attaches the family's
    own load-balancing loss with router_aux_loss_coef: every gradient equals that of
    transformers' `loss + router_aux_loss_coef * aux_loss` (1e-6), and the routers' differ from
    a forward without it."""
    torch.manual_seed(0)
    config = {**tiny_config(model_type), "output_router_logits": True, "router_aux_loss_coef": 0.5}
    model = build_hf(config, None, None)
    ids = torch.randint(0, 384, (2, 16), generator=torch.Generator().manual_seed(1))

    def grads(loss: torch.Tensor) -> dict[str, torch.Tensor]:
        model.zero_grad()
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    with aux_grad_scale(model, 1.0):
        logits = model(ids)
        ours = grads(
            torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        )
    theirs = grads(
        model.hf(input_ids=ids, labels=ids, output_router_logits=True, use_cache=False).loss
    )
    assert ours.keys() == theirs.keys()
    for name, grad in ours.items():
        torch.testing.assert_close(grad, theirs[name], rtol=1e-5, atol=1e-6, msg=name)
    model.hf.config.output_router_logits = False
    with aux_grad_scale(model, 1.0):
        logits = model(ids)
        plain = grads(
            torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        )
    router = next(n for n in ours if n.endswith("mlp.gate.weight"))
    assert not torch.allclose(plain[router], ours[router])


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_low_precision_layers_and_fp32_islands_are_resolved_per_family(model_type):
    """INT8 and FP8 (every nn.Linear by default) leave out each family's embeddings, output layer
    and routers (found by the router class the family declares, and a linear gate beside the
    experts); the routers are FP32 islands in every phase: under BF16 autocast their logits come
    out in FP32."""
    model = build(model_type)
    routers = [f"hf.{n}" for n, _ in router_modules(model.hf)]
    assert bool(routers) == (model_type in MOE)
    chosen, excluded = select_fp8_layers(model, Fp8Config(enabled=True), auto=False)
    fp8 = [cname for _, cname, _ in chosen]
    int8 = list(convert_to_int8(build(model_type), Int8Config(enabled=True)))
    for names in (fp8, int8):
        assert any(n.endswith(("q_proj", "qkv_proj", "q_a_proj")) or ".q_" in n for n in names)
        assert not [n for n in names if "embed" in n or "lm_head" in n], names
        assert not [n for n in names if any(n == r or n.startswith(r + ".") for r in routers)]
    islands = FP32Islands(model, "cpu")
    islands.set(())
    assert islands.names == routers
    if routers:
        seen = []
        router = model.hf.get_submodule(routers[0].removeprefix("hf."))
        handle = router.register_forward_hook(lambda m, a, out: seen.append(out[0].dtype))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(torch.tensor([[5, 6, 7]]))
        handle.remove()
        assert seen == [torch.float32]


@pytest.mark.parametrize("model_type", MOE)
def test_the_router_bias_drill_raises_one_experts_logit_through_the_routers_input(model_type):
    """drill.router_bias on a family's router (model/hf_routers.py): its logits come out raised by
    the bias (through its input), where the family computes its own top-k."""
    model = build(model_type).train()
    (name, router), *_ = router_modules(model.hf)
    probe = model.hf.get_submodule(name.rpartition(".")[0]).router_probe
    seen = []
    router.register_forward_hook(lambda m, a, out: seen.append(out[0].detach().float()))
    ids = torch.randint(0, 384, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(ids)
        probe.router_bias = torch.tensor([10.0, 0.0, 0.0, 0.0])
        model(ids)
    torch.testing.assert_close(
        seen[1] - seen[0], probe.router_bias.expand_as(seen[0]), atol=1e-3, rtol=0
    )


def test_router_metrics_and_culprits_are_named_by_the_familys_routers():
    """A family's probe reports under its router's name, and a router rule's anomaly names that
    router's weight (bigtrain's MoE: its block, and the block's router weight)."""
    model = build("qwen3_moe")
    layers = router_layers([model])
    assert list(layers) == ["hf.model.layers.0.mlp.gate", "hf.model.layers.1.mlp.gate"]
    names = {n for n, _ in model.named_parameters()}
    assert all(router_weight(layer) in names for layer in layers)
    assert router_weight("blocks.3") == "blocks.3.moe.router.weight"
