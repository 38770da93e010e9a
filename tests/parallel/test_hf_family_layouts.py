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

Llama's plan: tests/parallel/test_tp_hf.py; every family and layout: bench/families.py."""

from __future__ import annotations

import pytest

from tests.distributed import by_step, mesh_run_args, run_distributed, train_run, train_run_probed
from tests.hf_families import hf_config_override

pytestmark = pytest.mark.distributed

STEPS = 4
TP_FAMILIES = ("qwen3", "phi3", "deepseek_v3")
EP_FAMILIES = ("deepseek_v3",)


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


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus_files, cache_dir):
    tmp = tmp_path_factory.mktemp("hffam")
    out = {}
    for family in TP_FAMILIES:

        def args(name: str, *extra: str, family=family) -> list[str]:
            return mesh_run_args(
                tmp,
                f"{family}-{name}",
                corpus_files,
                cache_dir,
                "model.kind=hf",
                hf_config_override(family),
                f"train.max_steps={STEPS}",
                "parallel.backend=fsdp",
                *extra,
            )

        out[family, "local"] = train_run(args("local", "parallel.backend=local"))
        out[family, "tp"] = run_distributed(train_run, 2, args("tp", "parallel.tensor_parallel=2"))
        if family in EP_FAMILIES:
            out[family, "ep"] = run_distributed(
                train_run_probed, 2, args("ep", "parallel.expert_parallel=2"), family_experts
            )
    return out


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
    same_steps(runs[family, "local"], tp[0])
    start = next(e for e in tp[0]["events"] if e["kind"] == "start")
    assert start["world_size"] == 2


@pytest.mark.parametrize("family", EP_FAMILIES)
def test_ep2_by_the_declared_plan_trains_like_one_process(runs, family):
    ep = runs[family, "ep"]
    assert ep[0]["final"]["fingerprint"] == ep[1]["final"]["fingerprint"]
    same_steps(runs[family, "local"], ep[0])
    # layer 0 dense; layer 1: experts 0-1 on rank 0, 2-3 on rank 1, each counting its 2
    rank0, rank1 = (r["probe"]["experts"] for r in ep)
    assert rank0[0] is None and rank1[0] is None
    (offset0, shape0), local0 = rank0[1]
    (offset1, shape1), local1 = rank1[1]
    assert (offset0[0], shape0[0], local0) == (0, 2, 2)
    assert (offset1[0], shape1[0], local1) == (2, 2, 2)
