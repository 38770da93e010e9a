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
    """The one-process references, GPT-2 and Llama style."""
    tmp = tmp_path_factory.mktemp("pipeline-local")
    return {
        style: (
            *train_and_read_losses(common(tmp, style, corpus_files, cache_dir, *extra)),
            tmp / style,
        )
        for style, extra in (("gpt2", []), ("llama", LLAMA))
    }


@pytest.mark.parametrize(
    ("style", "schedule"),
    [("gpt2", "gpipe"), ("llama", "1f1b"), ("gpt2", "interleaved_1f1b"), ("llama", "zbv")],
)
def test_pp2_losses_match_the_local_run(
    local_runs, tmp_path, corpus_files, cache_dir, style, schedule
):
    extra = [*LLAMA] if style == "llama" else []
    args = common(
        tmp_path,
        "pp",
        corpus_files,
        cache_dir,
        *extra,
        "parallel.pipeline_parallel=2",
        f"parallel.pp_schedule={schedule}",
    )
    results = run_distributed(train_and_read_losses, 2, args)
    reference, ref_final, ref_dir = local_runs[style]
    losses, final = results[0]
    assert results[1][1]["fingerprint"] == final["fingerprint"]  # the stages agree
    assert_same_losses(losses, reference, f"pp=2 {schedule}")
    assert val_losses(tmp_path / "pp") == pytest.approx(val_losses(ref_dir), rel=1e-5)
