"""Pipeline stages train the same model to the same losses as one process (spawned, gloo, FP32),
heal across stages, and write the universal checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest

from bigtrain.store.rundir import read_jsonl
from tests.conftest import micro_overrides
from tests.distributed import run_distributed
from tests.parallel.test_equivalence import train_and_read_losses

pytestmark = pytest.mark.distributed

STEPS = 20
HF = {
    "hf-llama": [
        "model.kind=hf",
        "model.hf_config={model_type: llama, hidden_size: 64, intermediate_size: 128, "
        "num_hidden_layers: 4, num_attention_heads: 4, num_key_value_heads: 2, "
        "max_position_embeddings: 32}",
    ],
    "hf-gpt2": [  # tied table
        "model.kind=hf",
        "model.hf_config={model_type: gpt2, n_embd: 64, n_layer: 4, n_head: 4, n_positions: 32, "
        "bos_token_id: 0, eos_token_id: 0, resid_pdrop: 0, embd_pdrop: 0, attn_pdrop: 0}",
    ],
}
LLAMA = [
    "model.position=rope",
    "model.norm=rmsnorm",
    "model.mlp=swiglu",
    "model.bias=false",
    "model.tie_embeddings=false",
]


def common(tmp: Path, name: str, corpus_files, cache_dir, *extra: str) -> list[str]:
    return micro_overrides(tmp / name, corpus_files, cache_dir) + [
        "model.n_layers=4",
        f"train.max_steps={STEPS}",
        "train.log_every=1",
        "train.eval_every=10",
        "checkpoint.every=0",
        "precision.compute_dtype=fp32",
        "optim.grad_clip=0.05",  # below the micro model's norms: clipped every step
        *extra,
    ]


def assert_same_losses(losses: list[float], reference: list[float], label: str) -> None:
    assert len(losses) == len(reference) == STEPS
    for step, (a, b) in enumerate(zip(losses, reference, strict=True), start=1):
        assert a == pytest.approx(b, rel=1e-5), f"step {step}: {label} {a} vs local {b}"


def val_losses(out: Path) -> list[float]:
    return [m["val_loss"] for m in read_jsonl(out / "metrics.jsonl") if "val_loss" in m]


@pytest.fixture(scope="module")
def local_runs(tmp_path_factory, corpus_files, cache_dir):
    """The one-process references: bigtrain's GPT in GPT-2 and Llama style, and transformers'
    Llama and GPT-2."""
    tmp = tmp_path_factory.mktemp("pipeline-local")
    return {
        style: (
            *train_and_read_losses(common(tmp, style, corpus_files, cache_dir, *extra)),
            tmp / style,
        )
        for style, extra in (("gpt2", []), ("llama", LLAMA), *HF.items())
    }


@pytest.mark.parametrize(
    ("style", "schedule"),
    # tied tables: across ranks (gpipe: stages 0 and 1) and on one rank (zbv: stages 0 and 3)
    [
        ("gpt2", "gpipe"),
        ("llama", "1f1b"),
        ("llama", "interleaved_1f1b"),
        ("gpt2", "zbv-fsdp"),  # two FSDP2 chunks per rank, async checkpoints while they run
        ("hf-llama", "1f1b"),
        ("hf-gpt2", "gpipe"),
    ],
)
def test_pp2_losses_match_the_local_run(
    local_runs, tmp_path, corpus_files, cache_dir, style, schedule
):
    extra = {"gpt2": [], "llama": LLAMA, **HF}[style]
    if schedule.endswith("-fsdp"):
        schedule = schedule.removesuffix("-fsdp")
        extra = [*extra, "parallel.backend=fsdp", "checkpoint.every=5"]
    args = common(
        tmp_path,
        "pp",
        corpus_files,
        cache_dir,
        "parallel.pipeline_parallel=2",
        f"parallel.pp_schedule={schedule}",
        *extra,
    )
    results = run_distributed(train_and_read_losses, 2, args)
    reference, ref_final, ref_dir = local_runs[style]
    losses, final = results[0]
    assert results[1][1]["fingerprint"] == final["fingerprint"]  # the stages agree
    assert_same_losses(losses, reference, f"pp=2 {schedule}")
    assert val_losses(tmp_path / "pp") == pytest.approx(val_losses(ref_dir), rel=1e-5)
    if schedule == "gpipe":  # the checkpoint of a pipelined run, as any other
        check_saved_model(tmp_path / "pp", final["fingerprint"])


def check_saved_model(run_dir: Path, fingerprint: str) -> None:
    """The newest checkpoint of a pipelined run holds the whole model by the unsplit model's
    names: its weights hash to the run's fingerprint, it exports to Hugging Face with equal
    logits, and `generate` reads it."""
    from bigtrain.checkpoint.export import export_checkpoint, open_saved_model
    from bigtrain.inference import load_checkpoint_model
    from bigtrain.model.generate import Sampling
    from bigtrain.parallel.backends.base import weights_fingerprint

    saved = open_saved_model(run_dir)
    model = saved.model()
    assert weights_fingerprint((n, lambda p=p: p) for n, p in model.named_parameters()) == (
        fingerprint
    )
    exported = export_checkpoint(run_dir, run_dir / "hf", 1 << 30, check=True)
    assert exported["check"]["ok"], exported["check"]
    loaded = load_checkpoint_model(run_dir, device="cpu")
    sample = next(loaded.generate(["Enter"], Sampling(max_new_tokens=4, temperature=0.0)))
    assert 1 <= len(sample.tokens) <= 4


def test_bad_pipeline_configs_name_the_key(micro):
    from bigtrain.errors import ConfigError

    cases = {
        "parallel.pipeline_parallel": ["parallel.pipeline_parallel=3"],  # 3 stages, 2 blocks
        "parallel.pp_microbatches": [
            "parallel.pipeline_parallel=2",
            "parallel.pp_microbatches=3",  # does not divide 8
        ],
        "parallel.pp_schedule": ["parallel.pp_schedule=dualpipe"],
        "parallel.pp_split": [
            "model.n_layers=4",
            "parallel.pipeline_parallel=2",
            "parallel.pp_split=[4]",
        ],
    }
    for key, overrides in cases.items():
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            micro(*overrides)
    with pytest.raises(ConfigError, match="needs parallel.backend=local or fsdp"):
        micro("parallel.pipeline_parallel=2", "parallel.backend=zero")
    with pytest.raises(ConfigError, match="below parallel.pipeline_parallel"):
        micro("parallel.pipeline_parallel=2", "parallel.pp_microbatches=1")
    with pytest.raises(ConfigError, match="must be 1 for parallel.pp_schedule=1f1b"):
        micro("model.n_layers=4", "parallel.pipeline_parallel=2", "parallel.pp_stages_per_rank=2")
    with pytest.raises(ConfigError, match="data.document_mask"):
        micro("parallel.pipeline_parallel=2", "data.document_mask=true")


def test_fp16_overflow_is_one_verdict_across_stages(tmp_path, corpus_files, cache_dir):
    """FP16 with a loss scale that overflows: the non-finite gradients of the stages reach one
    verdict through the monitor, so both stages skip every step and back the scale off alike, and
    their weights stay the initial ones."""
    from tests.distributed import step0_fingerprint, train_run_probed

    args = micro_overrides(tmp_path / "fp16", corpus_files, cache_dir) + [
        "model.n_layers=4",
        "train.max_steps=3",
        "train.log_every=1",
        "train.eval_every=0",
        "checkpoint.every=0",
        "precision.compute_dtype=fp16",
        "precision.loss_scale=1e30",
        "precision.loss_scale_hysteresis=1",
        "parallel.pipeline_parallel=2",
    ]
    ranks = run_distributed(train_run_probed, 2, args, step0_fingerprint)
    for result in ranks:
        assert result["final"]["fingerprint"] == result["probe"]["fingerprint"]  # nothing applied
    metrics = [m for m in ranks[0]["metrics"] if "loss_scale" in m]
    assert [m["loss_scale"] for m in metrics] == [5e29, 2.5e29, 1.25e29]
    assert [m["skipped_steps"] for m in metrics] == [1, 2, 3]


def _blocks_while_unsharded(args: list[str]) -> list[str]:
    """In a rank: the checkpoint's block names of every master while FSDP2 shows a chunk's
    unsharded parameters (as it does while a schedule of several chunks runs, when an async
    checkpoint's writer thread reads them)."""
    from bigtrain.build import build_trainer
    from bigtrain.config import load_config
    from bigtrain.parallel.env import read_env

    trainer = build_trainer(load_config([], args), read_env())
    backend = trainer.backend
    for chunk in backend.model.chunks:
        chunk.unshard()  # FSDP2: the module now holds its gathered parameters
    masters, _ = backend.master_state()
    names = [b[0] for i, m in enumerate(masters) for b in backend.blocks(i, m)]
    for chunk in backend.model.chunks:
        chunk.reshard()
    trainer.callbacks.close()
    return names


def test_checkpoint_blocks_are_named_while_chunks_are_unsharded(tmp_path, corpus_files, cache_dir):
    args = common(
        tmp_path,
        "blocks",
        corpus_files,
        cache_dir,
        "parallel.backend=fsdp",
        "parallel.pipeline_parallel=2",
        "parallel.pp_schedule=zbv",
    )
    first, last = run_distributed(_blocks_while_unsharded, 2, args)
    assert "tok_emb.weight" in first and "blocks.0.attn.q.weight" in first
    assert "norm_f.weight" in first  # zbv: stage 3, the last, is on rank 0 too
    assert "blocks.1.attn.q.weight" in last and "tok_emb.weight" not in last
