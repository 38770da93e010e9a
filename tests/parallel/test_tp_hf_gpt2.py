"""A transformers GPT-2 (Conv1D layers, fused q/k/v) under tensor parallelism on 4 gloo ranks,
split by configs/parallel/tp2-hf-gpt2.yaml's plan: tp 2 x shard 2 trains like one process on the
same global batch, its monitor counts the tp-replicated c_attn once, and its DCP checkpoint
resumes on one process. FP32; dropout 0 except where the test says."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.distributed import by_step, mesh_run_args, run_distributed, train_run

pytestmark = pytest.mark.distributed

STEPS, STOP = 16, 12
GPT2 = (
    "model.hf_config={model_type: gpt2, n_embd: 64, n_layer: 2, n_head: 4, n_positions: 32, "
    "resid_pdrop: 0, embd_pdrop: 0, attn_pdrop: 0}"
)
TP_PLAN = (
    "parallel.tp_plan={attn.c_attn: colwise_qkv, attn.c_proj: rowwise, mlp.c_fc: colwise, "
    "mlp.c_proj: rowwise}"
)
TP2 = ["parallel.backend=fsdp", "parallel.tensor_parallel=2", TP_PLAN, "train.micro_batch_size=8"]
LOCAL = ["parallel.backend=local", "train.micro_batch_size=16"]


def _args(tmp: Path, name: str, corpus_files, cache_dir, *extra: str) -> list[str]:
    return mesh_run_args(
        tmp,
        name,
        corpus_files,
        cache_dir,
        "model.kind=hf",
        GPT2,
        f"train.max_steps={STEPS}",
        f"checkpoint.every={STOP}",
        *extra,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus_files, cache_dir):
    """One process for STEPS steps; tp 2 x shard 2 stopped at STOP (a checkpoint there); that
    checkpoint resumed on one process."""
    tmp = tmp_path_factory.mktemp("gpt2tp")
    local = train_run(_args(tmp, "local", corpus_files, cache_dir, *LOCAL))
    stop = f"train.stop_at_step={STOP}"
    tp = run_distributed(train_run, 4, _args(tmp, "tp", corpus_files, cache_dir, *TP2, stop))
    shutil.copytree(tmp / "tp", tmp / "resumed")
    resumed = train_run(_args(tmp, "resumed", corpus_files, cache_dir, *LOCAL))
    return local, tp[0], resumed


def test_tp2_losses_match_one_process(runs):
    local, tp = (by_step(r, "loss") for r in runs[:2])
    assert sorted(tp) == list(range(1, STOP + 1)) and tp.keys() <= local.keys()
    for step in tp:
        assert tp[step] == pytest.approx(local[step], rel=1e-4), step
    assert tp[STOP] < tp[1] - 0.3


def test_tp2_grad_norm_counts_the_replicated_c_attn_once(runs):
    """c_attn, norms and embeddings are whole on both tp ranks: counted once, not twice."""
    local, tp = (by_step(r, "grad_norm") for r in runs[:2])
    assert sorted(tp) == list(range(1, STOP + 1)) and tp.keys() <= local.keys()
    for step in tp:
        assert tp[step] == pytest.approx(local[step], rel=1e-5), step


def test_tp2_checkpoint_resumes_on_one_process(runs):
    local, _, resumed = runs
    assert [e["step"] for e in resumed["events"] if e["kind"] == "resume"] == [STOP]
    assert [m["step"] for m in resumed["metrics"] if "loss" in m] == list(range(1, STEPS + 1))
    before = by_step(local, "loss")
    after = {step: loss for step, loss in by_step(resumed, "loss").items() if step > STOP}
    assert sorted(after) == list(range(STOP + 1, STEPS + 1))
    for step in after:
        assert after[step] == pytest.approx(before[step], rel=1e-4), step


def test_with_dropout_the_tp_ranks_keep_one_residual_stream(tmp_path, corpus_files, cache_dir):
    """GPT-2's dropout on the residual stream, which every tp rank holds whole: the tp ranks share
    one seed and draw in step (their attention dropout covers as many heads each), so their
    copies of c_attn, the norms and embeddings stay equal (each rank fingerprints its own)."""
    dropout = GPT2.replace(
        "resid_pdrop: 0, embd_pdrop: 0, attn_pdrop: 0",
        "resid_pdrop: 0.1, embd_pdrop: 0.1, attn_pdrop: 0.1",
    )
    args = _args(tmp_path, "drop", corpus_files, cache_dir, *TP2, "train.max_steps=4", dropout)
    ranks = run_distributed(train_run, 4, args)
    assert len({r["final"]["fingerprint"] for r in ranks}) == 1


def test_colwise_qkv_on_a_linear_and_an_int8_conv1d_are_config_errors():
    from torch import nn
    from transformers.pytorch_utils import Conv1D

    from bigtrain.errors import ConfigError
    from bigtrain.parallel.tensor.plans import block_plan, check_styles
    from bigtrain.precision.int8 import Int8Layer

    block = nn.Module()
    block.q, block.out = nn.Linear(8, 8), Conv1D(8, 8)
    plan = block_plan(block, {"q": "colwise_qkv", "out": "rowwise"})
    with pytest.raises(ConfigError, match=r"colwise_qkv is for a fused q/k/v Conv1D"):
        check_styles(block, plan, {})
    block.out = Int8Layer(block.out, transposed=True, affine=True)
    with pytest.raises(ConfigError, match=r"matched out, a transformers Conv1D converted to INT8"):
        block_plan(block, {"out": "rowwise"})
