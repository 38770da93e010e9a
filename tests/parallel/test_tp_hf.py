"""Tensor parallelism of a `model.kind=hf` model by parallel.tp_plan on 4 gloo ranks: a
transformers Llama split tp 2 x shard 2 trains like one process on the same global batch and its
monitor counts tp-replicated tensors once. Checkpoints, rollback and the mesh-aware rest are
tested with bigtrain's GPT (test_tensor_parallel.py): nothing there depends on the plan."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed import by_step, mesh_run_args, run_distributed, train_run, train_run_probed
from tests.models import HF_LLAMA, HF_LLAMA_TP_PLAN

pytestmark = pytest.mark.distributed

STEPS = 20
LLAMA, TP_PLAN = HF_LLAMA, HF_LLAMA_TP_PLAN
TP2 = ["parallel.backend=fsdp", "parallel.tensor_parallel=2", TP_PLAN, "train.micro_batch_size=8"]


def _args(tmp: Path, name: str, corpus_files, cache_dir, *extra: str) -> list[str]:
    return mesh_run_args(tmp, name, corpus_files, cache_dir, "model.kind=hf", LLAMA, *extra)


@pytest.fixture(scope="module")
def local_and_tp(tmp_path_factory, corpus_files, cache_dir):
    tmp = tmp_path_factory.mktemp("tp")
    steps = f"train.max_steps={STEPS}"
    local = train_run(
        _args(tmp, "local", corpus_files, cache_dir, steps, "train.micro_batch_size=16")
    )
    tp = run_distributed(
        train_run_probed, 4, _args(tmp, "tp", corpus_files, cache_dir, steps, *TP2), layouts
    )
    assert len({r["final"]["fingerprint"] for r in tp}) == 1
    return local, tp[0], [r["probe"] for r in tp]


def test_tp2_losses_match_one_process(local_and_tp):
    local, tp = (by_step(r, "loss") for r in local_and_tp[:2])
    assert sorted(tp) == sorted(local) == list(range(1, STEPS + 1))
    for step, reference in local.items():
        assert tp[step] == pytest.approx(reference, rel=1e-4), step
    assert tp[STEPS] < tp[1] - 0.3


def test_tp2_grad_norm_counts_tp_replicated_tensors_once(local_and_tp):
    """Norm gains and embeddings are whole on both tp ranks: counted once, not twice."""
    local, tp = (by_step(r, "grad_norm") for r in local_and_tp[:2])
    assert sorted(tp) == sorted(local) == list(range(1, STEPS + 1))
    for step, reference in local.items():
        assert tp[step] == pytest.approx(reference, rel=1e-5), step


def layouts(trainer) -> dict:
    layer = trainer.backend.model.hf.model.layers[0]
    out = {}
    for name in ("self_attn.k_proj", "self_attn.o_proj", "input_layernorm"):
        weight = layer.get_submodule(name).weight
        out[name] = (
            weight.device_mesh.mesh_dim_names,
            [repr(p) for p in weight.placements],
            tuple(weight.shape),
            tuple(weight.to_local().shape),
        )
    out["batch"] = trainer.loader.rank, trainer.loader.world
    return out


def test_tp_plan_splits_the_matched_layers_and_tp_ranks_read_one_batch(local_and_tp):
    ranks = local_and_tp[2]
    k_proj = ranks[0]["self_attn.k_proj"]  # (2 kv heads x 16) x 64: rows over tp, then shard
    assert k_proj[0] == ("shard", "tp") and k_proj[1][1] == "Shard(dim=0)"
    assert k_proj[2] == (32, 64) and k_proj[3] == (8, 64)
    o_proj = ranks[0]["self_attn.o_proj"]  # rowwise: input features over tp
    assert o_proj[1] == ["Shard(dim=0)", "Shard(dim=1)"] and o_proj[3] == (32, 32)
    norm = ranks[0]["input_layernorm"]  # whole on each tp rank, sharded over shard only
    assert norm[0] == ("shard",) and norm[3] == (32,)
    assert [r["batch"] for r in ranks] == [(0, 2), (0, 2), (1, 2), (1, 2)]


def test_kv_heads_that_do_not_split_over_tp_are_a_config_error():
    from types import SimpleNamespace

    from bigtrain.errors import ConfigError
    from bigtrain.parallel.tensor.plans import check_divisible

    config = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2)
    model = SimpleNamespace(hf=SimpleNamespace(config=config))
    check_divisible(model, 2)
    with pytest.raises(ConfigError, match=r"must divide the model's num_key_value_heads \(2\)"):
        check_divisible(model, 4)
