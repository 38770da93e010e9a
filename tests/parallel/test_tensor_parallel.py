"""Tensor parallelism for bigtrain's GPT (parallel.tensor_parallel, its own plan with sequence and
loss parallelism) on 4 gloo ranks, tp 2 x shard 2: it trains like one process on the same global
batch (Llama style with grouped-query heads and tied embeddings; GPT-2 style with learned
positions and biases), its monitor's norm is the one-process norm, a NaN on one tp rank rolls
every rank back, and its DCP checkpoint resumes as shard 4 and on one process."""

from __future__ import annotations

import pytest

from bigtrain.config import load_config
from bigtrain.errors import ConfigError
from tests.distributed import (
    by_step,
    mesh_run_args,
    resume_copies,
    run_distributed,
    step0_fingerprint,
    train_run,
    train_run_probed,
)
from tests.models import GPT_LLAMA_STYLE

pytestmark = pytest.mark.distributed

STEPS = 20
LLAMA = (*GPT_LLAMA_STYLE, "model.tie_embeddings=true")
GPT2 = ("model.position=learned", "model.norm=layernorm", "model.mlp=gelu", "model.bias=true")
TP2 = ["parallel.backend=fsdp", "parallel.tensor_parallel=2", "train.micro_batch_size=8"]


_args = mesh_run_args


def placements(trainer) -> dict:
    """A rank's view of a few parameters after the split, and its step-0 fingerprint."""
    model = trainer.backend.model
    block = model.blocks[0]
    out = {"tied": model.lm_head.weight is model.tok_emb.weight}
    for name, module in (
        ("attn.k", block.attn.k),
        ("attn.proj", block.attn.proj),
        ("norm1", block.norm1),
        ("tok_emb", model.tok_emb),
    ):
        w = module.weight
        out[name] = (w.device_mesh.mesh_dim_names, [repr(p) for p in w.placements])
        out[name] += (tuple(w.shape), tuple(w.to_local().shape))
    out["batch"] = trainer.loader.rank, trainer.loader.world
    out["split_logits"] = trainer.backend.logits_split_by_vocab
    return {**out, **step0_fingerprint(trainer)}


@pytest.fixture(scope="module")
def local_and_tp(tmp_path_factory, corpus_files, cache_dir):
    """One process, and tp 2 x shard 2 built on the meta device (each rank draws only its tp x
    shard block) with selective checkpointing (which recomputes the sequence-parallel
    collectives in backward); each probed before its first step."""
    tmp = tmp_path_factory.mktemp("tp")
    steps = f"train.max_steps={STEPS}"
    local = train_run_probed(
        _args(tmp, "local", corpus_files, cache_dir, steps, *LLAMA, "train.micro_batch_size=16"),
        step0_fingerprint,
    )
    tp_args = [*LLAMA, *TP2, "parallel.activation_checkpointing=selective"]
    tp_args.append("parallel.meta_init=true")
    tp = run_distributed(
        train_run_probed, 4, _args(tmp, "tp", corpus_files, cache_dir, steps, *tp_args), placements
    )
    assert len({r["final"]["fingerprint"] for r in tp}) == 1
    return local, tp


def test_tp2_losses_match_one_process(local_and_tp):
    local, tp = by_step(local_and_tp[0], "loss"), by_step(local_and_tp[1][0], "loss")
    assert sorted(tp) == sorted(local) == list(range(1, STEPS + 1))
    for step, reference in local.items():
        assert tp[step] == pytest.approx(reference, rel=1e-4), step
    assert tp[STEPS] < tp[1] - 0.3


def test_tp2_grad_norm_is_the_one_process_norm(local_and_tp):
    """Norm gains are replicated over tp (counted once), split layers summed over tp."""
    local, tp = by_step(local_and_tp[0], "grad_norm"), by_step(local_and_tp[1][0], "grad_norm")
    assert sorted(tp) == sorted(local) == list(range(1, STEPS + 1))
    for step, reference in local.items():
        assert tp[step] == pytest.approx(reference, rel=1e-5), step


def test_the_plan_splits_heads_vocabulary_and_keeps_the_tie(local_and_tp):
    """Built on meta, the step-0 weights are one process's; the layers are split as planned."""
    local, ranks = local_and_tp[0], [r["probe"] for r in local_and_tp[1]]
    assert {x["fingerprint"] for x in ranks} == {local["probe"]["fingerprint"]}
    r = ranks[0]
    assert r["tied"] and r["split_logits"]
    # k: 2 kv heads x 16 = 32 rows, one head per tp rank, then halved again by FSDP2
    assert r["attn.k"][0] == ("shard", "tp") and r["attn.k"][2:] == ((32, 64), (8, 64))
    assert r["attn.proj"][1][1] == "Shard(dim=1)"  # rowwise: input features over tp
    assert r["norm1"][1][1] == "Replicate()"  # sequence parallel: whole gains, split tokens
    assert r["tok_emb"][1][1] == "Shard(dim=0)" and r["tok_emb"][2] == (384, 64)
    assert [x["batch"] for x in ranks] == [(0, 2), (0, 2), (1, 2), (1, 2)]


def test_gpt2_style_tp2_checkpoint_resumes_on_shard_4_and_one_process(
    tmp_path, corpus_files, cache_dir
):
    """Learned positions, biases, LayerNorm, GELU, document masks (per-token positions and
    masks pass the plan untouched); DCP reshards the tp x shard DTensors, and a local checkpoint
    loads into them: the losses after the checkpoint follow the uninterrupted tp run (FP32, same
    global batch)."""
    common = ["train.max_steps=7", "checkpoint.every=4", "data.document_mask=true", *GPT2]
    straight = run_distributed(
        train_run, 4, _args(tmp_path, "s", corpus_files, cache_dir, *common, *TP2)
    )[0]
    stop = "train.stop_at_step=4"
    run_distributed(
        train_run, 4, _args(tmp_path, "t", corpus_files, cache_dir, *common, *TP2, stop)
    )
    local = ["parallel.backend=local", "train.micro_batch_size=16"]
    train_run(_args(tmp_path, "l", corpus_files, cache_dir, *common, *local, stop))

    def make_args(name: str, *extra: str) -> list[str]:
        return _args(tmp_path, name, corpus_files, cache_dir, *common, *extra)

    dp4 = ["parallel.backend=fsdp", "train.micro_batch_size=4"]
    resume_copies(tmp_path, "t", (("dp4", 4, dp4), ("local", 1, local)), make_args, straight)
    # and back: a local checkpoint read into the tp x shard blocks (through its source)
    resume_copies(tmp_path, "l", (("tp-from-local", 4, TP2),), make_args, straight)


def test_a_nan_on_one_tp_rank_rolls_every_rank_back(tmp_path, corpus_files, cache_dir):
    args = _args(
        tmp_path,
        "nan",
        corpus_files,
        cache_dir,
        *LLAMA,
        *TP2,
        "train.max_steps=16",
        "train.log_every=5",
        "resilience.snapshot_every=5",
        "resilience.confirm_steps=3",
        "monitor.every=1",
        "drill.rank=1",  # tp rank 1 of the first tp group
        "drill.nan_grad_step=12",
        "model.dropout=0.1",  # masks drawn per tp rank in the sequence-parallel region
        "parallel.activation_checkpointing=block",  # the plan reaches inside the wrapper
    )
    ranks = run_distributed(train_run, 4, args)
    assert len({r["final"]["fingerprint"] for r in ranks}) == 1
    for r in ranks:
        assert r["final"]["rollbacks"] == 1
        anomaly = next(e for e in r["events"] if e["kind"] == "anomaly")
        assert (anomaly["step"], anomaly["type"]) == (12, "nonfinite")
        rollback = next(e for e in r["events"] if e["kind"] == "rollback")
        assert (rollback["from_step"], rollback["to_step"]) == (12, 5)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.n_heads=4", "model.n_kv_heads=1"], r"must divide model.n_kv_heads = 1"),
        (["model.n_heads=2", "parallel.tensor_parallel=4"], r"\(4\) must divide model.n_heads = 2"),
        (["model.seq_len=33"], r"model.seq_len = 33"),
        (["parallel.tp_plan={attn.q: colwise}"], r"tp_plan.*is for model.kind=hf"),
    ],
)
def test_gpt_shapes_that_do_not_split_over_tp_are_config_errors(overrides, message):
    base = ["parallel.backend=fsdp", "parallel.tensor_parallel=2", "model.d_model=64"]
    with pytest.raises(ConfigError, match=message):
        load_config([], [*base, *overrides])


def test_a_vocabulary_that_does_not_split_names_a_padded_size():
    from bigtrain.config.parallel import check_gpt_tensor_parallel
    from bigtrain.config.schema import ModelConfig

    m = ModelConfig(n_heads=4, d_model=64, seq_len=32, vocab_size=50257)
    with pytest.raises(ConfigError, match=r"vocab size = 50257.*model.vocab_size=50304"):
        check_gpt_tensor_parallel(m, 2)
    check_gpt_tensor_parallel(ModelConfig(n_heads=4, d_model=64, seq_len=32, vocab_size=50304), 2)
