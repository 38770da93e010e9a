"""The same recovery on every backend and mesh: FSDP2, ZeRO-1/2/3 (2 gloo ranks), HSDP, tp 2 x
dp 2 and two pipeline stages of 2 FSDP2 shards (4 ranks; the faults on stage 1 only) roll back
like one process (FP32, global batch 16, clipping on every step):
a NaN gradient on rank 1 at step 3 goes back to the start, a x50 loss spike on rank 1 at step 14
goes back to snapshot 10, and the kept trajectory follows local's within FP32 rounding (1e-5
relative) over the steps after each, with one fingerprint on all ranks."""

from __future__ import annotations

import pytest

from bigtrain.telemetry.trajectory import split_trajectory
from tests.distributed import mesh_run_args, run_distributed, train_run

pytestmark = pytest.mark.distributed

LADDER = (
    "train.max_steps=22",
    "resilience.snapshot_every=5",
    "resilience.confirm_steps=3",
    "resilience.window=0",  # each anomaly on its own, not a repeat of the one before
    "drill.nan_grad_step=3",
    "drill.spike_step=14",
    "drill.spike_factor=50",
)
BACKENDS = {
    "fsdp": (2, ["parallel.backend=fsdp"]),
    "zero1": (2, ["parallel.backend=zero", "parallel.zero_stage=1"]),
    "zero2": (2, ["parallel.backend=zero", "parallel.zero_stage=2"]),
    "zero3": (2, ["parallel.backend=zero", "parallel.zero_stage=3"]),
    "hsdp": (4, ["parallel.backend=fsdp", "parallel.replicate=2", "train.micro_batch_size=4"]),
    "tp2xdp2": (4, ["parallel.backend=fsdp", "parallel.tensor_parallel=2"]),
    # ranks 2 and 3 are stage 1's two shards; the faults hit shard 1 of stage 1
    "pp2xfsdp2": (
        4,
        [
            "parallel.backend=fsdp",
            "parallel.pipeline_parallel=2",
            "parallel.pp_microbatches=4",
            "drill.rank=3",
        ],
    ),
}


def kept(result: dict) -> dict[int, float]:
    records = [m for m in result["metrics"] if "loss" in m]
    return {m["step"]: m["loss"] for m in split_trajectory(records)[0]}


def rollbacks(result: dict) -> list[tuple]:
    return [
        (e["from_step"], e["to_step"], e["source"])
        for e in result["events"]
        if e["kind"] == "rollback"
    ]


@pytest.fixture(scope="module")
def local(tmp_path_factory, corpus_files, cache_dir) -> dict:
    tmp = tmp_path_factory.mktemp("local")
    args = mesh_run_args(tmp, "local", corpus_files, cache_dir, *LADDER, "drill.rank=0")
    return train_run(args)


@pytest.mark.parametrize("name", list(BACKENDS))
def test_every_backend_rolls_back_like_one_process(tmp_path, corpus_files, cache_dir, local, name):
    world, extra = BACKENDS[name]
    args = mesh_run_args(tmp_path, name, corpus_files, cache_dir, *LADDER, "drill.rank=1", *extra)
    ranks = run_distributed(train_run, world, args)
    assert len({r["final"]["fingerprint"] for r in ranks}) == 1  # every rank, the same weights
    result = ranks[0]
    assert rollbacks(result) == rollbacks(local) == [(3, 0, "memory"), (14, 10, "memory")]
    expected, got = kept(local), kept(result)
    assert sorted(got) == sorted(expected) == list(range(1, 23))
    for step in range(1, 21):  # the 10 steps after each rollback
        assert got[step] == pytest.approx(expected[step], rel=1e-5), (name, step)


def test_fsdp_heals_after_a_resume_like_the_run_that_never_stopped(
    tmp_path, corpus_files, cache_dir
):
    """FSDP2 on 2 ranks, checkpoints every 10 steps, snapshots every 25: a NaN at step 37 goes
    back to target 25, held in memory by the uninterrupted run; the run stopped at 30 lost that
    snapshot and rebuilds it from checkpoint 20. The same target, weights and kept losses."""
    common = [
        "parallel.backend=fsdp",
        "train.max_steps=40",
        "checkpoint.every=10",
        "checkpoint.async_save=false",
        "drill.nan_grad_step=37",
        "drill.rank=1",
    ]
    straight_args = mesh_run_args(tmp_path, "straight", corpus_files, cache_dir, *common)
    stopped_args = mesh_run_args(tmp_path, "stopped", corpus_files, cache_dir, *common)
    straight = run_distributed(train_run, 2, straight_args)[0]
    run_distributed(train_run, 2, [*stopped_args, "train.stop_at_step=30"])
    resumed = run_distributed(train_run, 2, stopped_args)[0]
    assert rollbacks(straight) == [(37, 25, "memory")]
    assert rollbacks(resumed) == [(37, 25, "replay from checkpoint")]
    assert resumed["final"]["fingerprint"] == straight["final"]["fingerprint"]
    assert kept(resumed) == kept(straight)
