"""A mixture on two FSDP2 ranks trains on the same global batches as one local process: the same
losses step by step, tokens_by_source and source_exhausted at the same steps, and the ranks agree
on the final weights. The setup's shard check (rank 0) runs with a process group."""

from __future__ import annotations

from pathlib import Path

import pytest

from bigtrain.parallel.env import DistEnv
from bigtrain.runner import run
from bigtrain.store.rundir import read_jsonl
from tests.data.conftest import mixture_args
from tests.distributed import run_distributed, train_run

pytestmark = pytest.mark.distributed

FP32 = ["precision.compute_dtype=fp32", "train.log_every=1", "train.eval_every=0"]


def test_two_ranks_train_on_the_one_rank_mixture(micro, micro_args, mixture_sources):
    local_cfg = micro(*mixture_args(mixture_sources), *FP32, out="local")
    run(local_cfg, DistEnv())
    local = [m for m in read_jsonl(Path(local_cfg.train.out_dir) / "metrics.jsonl") if "loss" in m]
    args = micro_args(
        *mixture_args(mixture_sources),
        *FP32,
        "train.micro_batch_size=128",  # 2 ranks x 128: the same global batch of 256
        "parallel.backend=fsdp",
        out="fsdp",
    )
    ranks = run_distributed(train_run, 2, args)
    assert ranks[0]["final"]["fingerprint"] == ranks[1]["final"]["fingerprint"]
    sharded = [m for m in ranks[0]["metrics"] if "loss" in m]
    assert len(sharded) == len(local) == 6
    for a, b in zip(sharded, local, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), a["step"]
        assert a["tokens_by_source"] == b["tokens_by_source"]
    local_events = read_jsonl(Path(local_cfg.train.out_dir) / "events.jsonl")
    [one] = [e for e in local_events if e["kind"] == "source_exhausted"]
    [two] = [e for e in ranks[0]["events"] if e["kind"] == "source_exhausted"]
    assert (one["step"], one["position"]) == (two["step"], two["position"])
