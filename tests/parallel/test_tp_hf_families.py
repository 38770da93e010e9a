"""Tensor parallelism of transformers families by the plans they declare (model/hf_plans.py), no
parallel.tp_plan given: tp 2 on 2 gloo ranks trains like one process, per-step losses and
gradient norms within 1e-5 (FP32), for a family of each declared style beyond colwise/rowwise:
Qwen3 (its per-head q/k norms: whole weights, gradients summed over the tp ranks), Phi-3 (fused
q/k/v and gate/up projections gathered, the output projections splitting their input; OLMo 2's
gathered q/k/v run the same styles: bench/families.py) and DeepSeek-V3 (MLA: the shared rotary key's
gradient summed; a dense layer, then shared and routed experts, the experts whole on both tp
ranks). Llama's plan: tests/parallel/test_tp_hf.py; every family and layout: bench/families.py."""

from __future__ import annotations

import pytest

from tests.distributed import by_step, mesh_run_args, run_distributed, train_run
from tests.hf_families import hf_config_override

pytestmark = pytest.mark.distributed

STEPS = 4
FAMILIES = ("qwen3", "phi3", "deepseek_v3")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus_files, cache_dir):
    tmp = tmp_path_factory.mktemp("tpfam")
    out = {}
    for family in FAMILIES:

        def args(name: str, *extra: str, family=family) -> list[str]:
            return mesh_run_args(
                tmp,
                f"{family}-{name}",
                corpus_files,
                cache_dir,
                "model.kind=hf",
                hf_config_override(family),
                f"train.max_steps={STEPS}",
                *extra,
            )

        local = train_run(args("local"))
        tp = run_distributed(
            train_run, 2, args("tp", "parallel.backend=fsdp", "parallel.tensor_parallel=2")
        )
        assert tp[0]["final"]["fingerprint"] == tp[1]["final"]["fingerprint"]
        out[family] = (local, tp[0])
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_by_the_declared_plan_trains_like_one_process(runs, family):
    local, tp = runs[family]
    for key in ("loss", "grad_norm"):
        ref, got = by_step(local, key), by_step(tp, key)
        assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1)), key
        for step, value in ref.items():
            assert got[step] == pytest.approx(value, rel=1e-5), (key, step)
    start = next(e for e in tp["events"] if e["kind"] == "start")
    assert start["world_size"] == 2
