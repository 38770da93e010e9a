"""transformers families on bigtrain's layouts by the plans they declare (model/hf_plans.py),
on 2 gloo ranks, trained like one process: per-step losses and gradient norms within 1e-5 (FP32).

Tensor parallelism 2, no parallel.tp_plan given, for a family of each declared style beyond
colwise/rowwise: Qwen3 (its per-head q/k norms: whole weights, gradients summed over the tp
ranks), Phi-3 (fused q/k/v and gate/up projections gathered, the output projections splitting
their input; OLMo 2's gathered q/k/v run the same styles: bench/families.py) and DeepSeek-V3
(MLA: the shared rotary key's gradient summed; a dense layer, then shared and routed experts, the
experts whole on both tp ranks).

Expert parallelism 2 for DeepSeek-V3 by its declared ep plan: each rank holds 2 of the MoE
layer's 4 experts, its dense first layer and shared expert stay whole, and the tokens of both
ranks reach their experts through the family's own expert math (parallel/experts.py).

Every run starts from a Hub directory that transformers saved (`model.init_from`; DeepSeek-V3's
experts one tensor per expert on disk, stacked in memory): each layout loads the weights
transformers loads (the init_from event's fingerprint). The DeepSeek-V3 expert-parallel run's
last checkpoint goes back out: `bigtrain export --hf --check` passes, the export has the Hub
directory's tensor names, and `bigtrain generate`'s greedy ids are transformers' own.

Llama's plan: tests/parallel/test_tp_hf.py; every family and layout: bench/families.py."""

from __future__ import annotations

import math

import pytest

from tests.distributed import by_step, mesh_run_args, run_distributed, train_run, train_run_probed
from tests.hf_families import hub_fingerprint, round_trip, save_hub_dir

pytestmark = pytest.mark.distributed

STEPS = 4
TP_FAMILIES = ("qwen3", "phi3", "deepseek_v3")
FAMILIES = (*TP_FAMILIES, "qwen3_moe")
EP_FAMILIES = ("deepseek_v3",)
BF16_FAMILIES = ("qwen3_moe",)


def family_experts(trainer) -> dict:
    """A probe: each decoder layer's experts module, where it has one: this rank's block of its
    stacked gate/up weight and the experts its forward counts."""
    from bigtrain.utils.tensors import local_block

    layers = trainer.backend.model.hf.model.layers
    return {
        "experts": [
            [local_block(layer.mlp.experts.gate_up_proj), layer.mlp.experts.num_experts]
            if hasattr(layer.mlp, "experts")
            else None
            for layer in layers
        ]
    }


def router_gathers(trainer) -> dict:
    """A probe: the dtype FSDP2 gathers each router and each decoder layer in."""
    from torch.distributed.fsdp import FSDPModule

    def gathered(module) -> str | None:
        if not isinstance(module, FSDPModule):
            return None
        return str(module._get_fsdp_state()._mp_policy.param_dtype)

    hf = trainer.backend.model.hf
    return {
        "routers": [gathered(layer.mlp.gate) for layer in hf.model.layers[1:]],
        "layers": [gathered(layer) for layer in hf.model.layers],
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus_files, cache_dir):
    tmp = tmp_path_factory.mktemp("hffam")
    out = {}
    for family in FAMILIES:
        hub = save_hub_dir(family, tmp / f"{family}-hub")
        out[family, "hub"] = hub, hub_fingerprint(hub)

        def args(name: str, *extra: str, family=family, hub=hub) -> list[str]:
            return mesh_run_args(
                tmp,
                f"{family}-{name}",
                corpus_files,
                cache_dir,
                "model.kind=hf",
                f"model.init_from={hub}",
                f"train.max_steps={STEPS}",
                "parallel.backend=fsdp",
                *extra,
            )

        if family in TP_FAMILIES:
            out[family, "local"] = train_run(args("local", "parallel.backend=local"))
            tp = args("tp", "parallel.tensor_parallel=2")
            out[family, "tp"] = run_distributed(train_run, 2, tp)
        if family in BF16_FAMILIES:  # the routers gathered in FP32 beside BF16 layers
            bf16 = args("bf16", "precision.compute_dtype=bf16", "train.max_steps=2")
            out[family, "bf16"] = run_distributed(train_run_probed, 1, bf16, router_gathers)[0]
        if family in EP_FAMILIES:
            ep_args = args("ep", "parallel.expert_parallel=2", f"checkpoint.every={STEPS}")
            out[family, "ep"] = run_distributed(train_run_probed, 2, ep_args, family_experts)
            checkpoint = tmp / f"{family}-ep" / "checkpoints" / f"step_{STEPS:08d}"
            out[family, "round_trip"] = round_trip(checkpoint, hub, tmp / f"{family}-out")
    return out


def loaded_the_hub_weights(runs, family: str, run: dict) -> None:
    init = next(e for e in run["events"] if e["kind"] == "init_from")
    assert init["source"] == "huggingface"
    assert init["fingerprint"] == runs[family, "hub"][1]


def same_steps(local: dict, parallel: dict) -> None:
    for key in ("loss", "grad_norm"):
        ref, got = by_step(local, key), by_step(parallel, key)
        assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1)), key
        for step, value in ref.items():
            assert got[step] == pytest.approx(value, rel=1e-5), (key, step)


@pytest.mark.parametrize("family", TP_FAMILIES)
def test_tp2_by_the_declared_plan_trains_like_one_process(runs, family):
    tp = runs[family, "tp"]
    assert tp[0]["final"]["fingerprint"] == tp[1]["final"]["fingerprint"]
    loaded_the_hub_weights(runs, family, runs[family, "local"])
    loaded_the_hub_weights(runs, family, tp[0])
    same_steps(runs[family, "local"], tp[0])
    start = next(e for e in tp[0]["events"] if e["kind"] == "start")
    assert start["world_size"] == 2


@pytest.mark.parametrize("family", EP_FAMILIES)
def test_ep2_by_the_declared_plan_trains_like_one_process(runs, family):
    ep = runs[family, "ep"]
    assert ep[0]["final"]["fingerprint"] == ep[1]["final"]["fingerprint"]
    loaded_the_hub_weights(runs, family, ep[0])
    same_steps(runs[family, "local"], ep[0])
    # the routers watched on both (model/hf_routers.py): the same loads, reduced over the ranks
    for key in ("moe_load_max_mean", "moe_load_entropy", "moe_z_loss"):
        ref, got = by_step(runs[family, "local"], key), by_step(ep[0], key)
        assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1)), key
        for step, value in ref.items():
            assert got[step] == pytest.approx(value, rel=1e-5), (key, step)
    layers = {m["step"]: m["moe_layer_load"] for m in ep[0]["metrics"] if "moe_layer_load" in m}
    assert list(layers[1]) == ["hf.model.layers.1.mlp.gate"]  # the family's name of its router
    norms = next(m["layer_grad_norm"] for m in ep[0]["metrics"] if "layer_grad_norm" in m)
    assert {"hf.model.layers.0", "hf.model.layers.1"} <= set(norms)  # per decoder layer
    # layer 0 dense; layer 1: experts 0-1 on rank 0, 2-3 on rank 1, each counting its 2
    rank0, rank1 = (r["probe"]["experts"] for r in ep)
    assert rank0[0] is None and rank1[0] is None
    (offset0, shape0), local0 = rank0[1]
    (offset1, shape1), local1 = rank1[1]
    assert (offset0[0], shape0[0], local0) == (0, 2, 2)
    assert (offset1[0], shape1[0], local1) == (2, 2, 2)


@pytest.mark.parametrize("family", EP_FAMILIES)
def test_an_expert_parallel_checkpoint_exports_to_the_hub_layout_and_generates(runs, family):
    result = runs[family, "round_trip"]
    assert result["export"] == 0 and result["check"]["ok"], result["check"]
    assert result["check"]["max_rel_diff"] <= 1e-5
    assert result["same_names"]  # one tensor per expert, as the Hub directory it came from
    # the router's score correction (a persistent buffer, random in the Hub directory) came in
    # and went out as it was; every trained weight changed
    assert result["unchanged"] == ["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert result["generate"] == 0 and result["ours"] == result["theirs"]
    assert len(result["ours"]) > 0


@pytest.mark.parametrize("family", BF16_FAMILIES)
def test_the_routers_are_fp32_islands_beside_bf16_layers(runs, family):
    """BF16 compute on FSDP2 (one spawned rank): the decoder layers are gathered in BF16, the routers
    (FP32 islands by type: precision/islands.py) in FP32 in groups of their own; the run trains
    (Qwen3-MoE's router multiplies its input by its weight in the compute dtype: gathered in
    BF16 under the FP32 island, it failed)."""
    result = runs[family, "bf16"]
    assert result["probe"]["routers"] == ["torch.float32"]
    assert set(result["probe"]["layers"]) == {"torch.bfloat16"}
    losses = by_step(result, "loss")
    assert sorted(losses) == [1, 2] and all(math.isfinite(v) for v in losses.values())
    assert "moe_z_loss" in result["metrics"][-1]
