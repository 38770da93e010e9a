"""HSDP (fsdp with parallel.replicate > 1) on 4 gloo ranks: a replicate 2 x shard 2 mesh trains
like one process on the same global batch, its monitor counts replicated shards once, and its
DCP checkpoints resume on other meshes."""

from __future__ import annotations

import pytest

from tests.distributed import (
    by_step,
    mesh_run_args,
    resume_copies,
    run_distributed,
    step0_fingerprint,
    train_run,
    train_run_probed,
)

pytestmark = pytest.mark.distributed

STEPS = 20


_args = mesh_run_args


@pytest.fixture(scope="module")
def local_and_hsdp(tmp_path_factory, corpus_files, cache_dir):
    tmp = tmp_path_factory.mktemp("hsdp")
    steps = f"train.max_steps={STEPS}"
    local = train_run_probed(
        _args(tmp, "local", corpus_files, cache_dir, steps, "train.micro_batch_size=16"),
        step0_fingerprint,
    )
    hsdp = run_distributed(
        train_run_probed,
        4,
        _args(
            tmp,
            "hsdp",
            corpus_files,
            cache_dir,
            steps,
            "parallel.backend=fsdp",
            "parallel.replicate=2",
            "parallel.meta_init=true",  # each rank draws and keeps only its (replicated) shard
            "train.micro_batch_size=2",  # 2 micro-batches: replicas sync on the last one only
        ),
        step0_fingerprint,
    )
    assert len({r["final"]["fingerprint"] for r in hsdp}) == 1  # replicas hold the same weights
    return local, hsdp[0], [r["probe"]["fingerprint"] for r in hsdp]


def test_hsdp_losses_match_one_process(local_and_hsdp):
    local, hsdp = (by_step(r, "loss") for r in local_and_hsdp[:2])
    assert sorted(hsdp) == sorted(local) == list(range(1, STEPS + 1))
    for step, reference in local.items():
        assert hsdp[step] == pytest.approx(reference, rel=1e-4), step
    assert hsdp[STEPS] < hsdp[1] - 0.3  # and it trains


def test_hsdp_grad_norm_counts_each_replicated_shard_once(local_and_hsdp):
    """Each replica holds the same shards: summed over all 4 ranks unweighted, the norm would be
    sqrt(2) too large (and clipping too strong)."""
    local, hsdp = (by_step(r, "grad_norm") for r in local_and_hsdp[:2])
    assert sorted(hsdp) == sorted(local) == list(range(1, STEPS + 1))
    for step, reference in local.items():
        assert hsdp[step] == pytest.approx(reference, rel=1e-5), step


def test_hsdp_checkpoint_resumes_on_fsdp_and_one_process_and_back(
    tmp_path, corpus_files, cache_dir
):
    """DCP reshards: a replicate 2 x shard 2 checkpoint resumes as shard 4 and as one local
    process, and a local checkpoint resumes as replicate 2 x shard 2 (same global batch); the
    losses after the checkpoint follow the uninterrupted run."""
    hsdp = ["parallel.backend=fsdp", "parallel.replicate=2", "train.micro_batch_size=4"]
    common = ["train.max_steps=7", "checkpoint.every=4"]
    straight = run_distributed(
        train_run, 4, _args(tmp_path, "s", corpus_files, cache_dir, *common, *hsdp)
    )[0]
    run_distributed(
        train_run,
        4,
        _args(tmp_path, "h", corpus_files, cache_dir, *common, *hsdp, "train.stop_at_step=4"),
    )
    resume_copies(
        tmp_path,
        "h",
        (
            ("fsdp4", 4, ["parallel.backend=fsdp", "train.micro_batch_size=4"]),
            ("local", 1, ["parallel.backend=local", "train.micro_batch_size=16"]),
        ),
        lambda name, *extra: _args(tmp_path, name, corpus_files, cache_dir, *common, *extra),
        straight,
    )
    local = ["parallel.backend=local", "train.micro_batch_size=16", "train.stop_at_step=4"]
    run_distributed(train_run, 1, _args(tmp_path, "back", corpus_files, cache_dir, *common, *local))
    resumed = run_distributed(
        train_run, 4, _args(tmp_path, "back", corpus_files, cache_dir, *common, *hsdp)
    )[0]
    assert "resume" in [e["kind"] for e in resumed["events"]]
    before, after = by_step(straight, "loss"), by_step(resumed, "loss")
    for step in (5, 6, 7):
        assert after[step] == pytest.approx(before[step], rel=1e-4), ("back", step)


def test_hsdp_built_on_meta_starts_from_the_weights_of_one_process(local_and_hsdp):
    """parallel.meta_init on the 2D mesh (the fixture's run): each rank draws and keeps only its
    (replicated) shard, and the step-0 weights are one process's."""
    local, _, ranks = local_and_hsdp
    assert set(ranks) == {local["probe"]["fingerprint"]}


def test_a_nan_on_one_replica_rolls_every_rank_back_together(tmp_path, corpus_files, cache_dir):
    """Rank 3 (replica 1, shard 2 of 2) gets a NaN gradient after the all-reduce: half of it
    counts (its replica twin is clean), still a non-finite anomaly on every rank, and all 4
    roll back to the same snapshot, holding identical weights afterwards."""
    args = _args(
        tmp_path,
        "nan",
        corpus_files,
        cache_dir,
        "parallel.backend=fsdp",
        "parallel.replicate=2",
        "train.micro_batch_size=4",
        "train.max_steps=16",
        "train.log_every=5",
        "resilience.snapshot_every=5",
        "resilience.confirm_steps=3",
        "monitor.every=1",
        "drill.rank=3",
        "drill.nan_grad_step=12",
    )
    ranks = run_distributed(train_run, 4, args)
    assert len({r["final"]["fingerprint"] for r in ranks}) == 1
    for r in ranks:
        assert r["final"]["rollbacks"] == 1
        anomaly = next(e for e in r["events"] if e["kind"] == "anomaly")
        assert (anomaly["step"], anomaly["type"], anomaly["metric"]) == (12, "nonfinite", "grads")
        rollback = next(e for e in r["events"] if e["kind"] == "rollback")
        assert (rollback["from_step"], rollback["to_step"]) == (12, 5)
