"""Samples during sharded runs: every rank decodes together (FSDP2 gathers the weights in each
forward; tensor parallelism splits each forward's sequence and vocabulary), rank 0 writes, and the
text is the single-process run's on the same global batch."""

from __future__ import annotations

from pathlib import Path

import pytest

from bigtrain.config import load_config
from bigtrain.parallel.env import read_env
from bigtrain.runner import run
from bigtrain.store.rundir import read_jsonl
from tests.conftest import micro_overrides
from tests.distributed import run_distributed, train_run

pytestmark = pytest.mark.distributed

COMMON = [
    "train.max_steps=2",
    "train.global_batch_size=16",
    "train.eval_every=0",
    "checkpoint.every=0",
    "precision.compute_dtype=fp32",
    "model.init_std=0.3",
    "eval.sample_every=1",
    "eval.sample_prompts=['ROMEO:', '']",
    "eval.sample_max_new_tokens=6",
]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, corpus_files, cache_dir) -> list[dict]:
    out = tmp_path_factory.mktemp("samples") / "local"
    run(load_config([], micro_overrides(out, corpus_files, cache_dir) + COMMON), read_env())
    return read_jsonl(out / "samples.jsonl")


@pytest.mark.parametrize(
    "mesh",
    [["parallel.backend=fsdp"], ["parallel.backend=fsdp", "parallel.tensor_parallel=2"]],
    ids=["fsdp2", "tp2"],
)
def test_ranks_sample_together_the_text_of_one_process(
    one_process, tmp_path, corpus_files, cache_dir, mesh
):
    run_distributed(
        train_run, 2, micro_overrides(tmp_path, corpus_files, cache_dir) + COMMON + mesh
    )
    sharded = read_jsonl(Path(tmp_path / "samples.jsonl"))
    steps = [(1, "ROMEO:"), (1, ""), (2, "ROMEO:"), (2, "")]
    assert [(r["step"], r["prompt"]) for r in sharded] == steps  # written once: rank 0
    assert [r["tokens"] for r in sharded] == [r["tokens"] for r in one_process]
    assert all(len(r["tokens"]) == 6 for r in sharded)
    assert sharded[2]["tokens"] != sharded[0]["tokens"]  # step 2's weights are another model's
