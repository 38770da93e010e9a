"""FSDP2 and ZeRO internals on 2 gloo ranks: FP32 master shards, BF16 compute, gradient views,
skips, snapshots, checkpoints across world sizes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from bigtrain.build import build_trainer
from bigtrain.config import load_config
from bigtrain.parallel.env import read_env, shutdown
from bigtrain.runner import run
from bigtrain.store.rundir import read_jsonl
from tests.conftest import micro_overrides
from tests.distributed import initial_fingerprint, run_distributed, train_run

pytestmark = pytest.mark.distributed


def _args(tmp: Path, name: str, corpus_files, cache_dir, *extra: str) -> list[str]:
    return micro_overrides(tmp / name, corpus_files, cache_dir) + list(extra)


def inspect_shards(args: list[str]) -> dict:
    """Build a trainer, run one step with hooks on every Linear, report dtypes and shard sizes."""
    trainer = build_trainer(load_config([], args), read_env())
    try:
        seen = set()
        for m in trainer.backend.model.modules():
            if isinstance(m, nn.Linear):
                m.register_forward_hook(
                    lambda mod, i, o: seen.add((str(mod.weight.dtype), str(o.dtype)))
                )
        trainer.train_step()
        model = trainer.backend.model
        if trainer.backend.name == "fsdp":
            master = [(p.to_local().numel(), p.numel(), str(p.dtype)) for p in model.parameters()]
        else:
            opt = trainer.backend.optimizer
            flat = (
                getattr(opt, "single_partition_of_fp32_groups", None)
                or opt.fp32_partitioned_groups_flat
            )
            master = [(f.numel(), None, str(f.dtype)) for f in flat]
        total = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters())
        return {"linear": sorted(seen), "master": master, "total": total}
    finally:
        trainer.callbacks.close()
        shutdown(clean=False)


@pytest.mark.parametrize("backend", ["fsdp", "zero"])
def test_master_weights_fp32_and_sharded_compute_bf16(tmp_path, corpus_files, cache_dir, backend):
    args = _args(
        tmp_path,
        backend,
        corpus_files,
        cache_dir,
        f"parallel.backend={backend}",
        "parallel.zero_stage=3",
        "precision.compute_dtype=bf16",
        "train.eval_every=0",
    )
    ranks = run_distributed(inspect_shards, 2, args)
    for r in ranks:
        assert r["linear"] == [("torch.bfloat16", "torch.bfloat16")]  # matmuls see BF16 weights
        assert {dtype for _, _, dtype in r["master"]} == {"torch.float32"}
        local = sum(n for n, _, _ in r["master"])
        assert 0.45 * r["total"] <= local <= 0.55 * r["total"], (
            local,
            r["total"],
        )  # about half each


def skip_on_nan(args: list[str]) -> dict:
    final = run(load_config([], args), read_env())
    events = read_jsonl(Path(load_config([], args).train.out_dir) / "events.jsonl")
    anomalies = [e for e in events if e["kind"] == "anomaly"]
    return {
        "final": final,
        "anomalies": [e["step"] for e in anomalies],
        "tensors": [e["tensor"] for e in anomalies],
    }


@pytest.mark.parametrize("backend", ["fsdp", "zero"])
def test_nan_on_one_rank_is_skipped_by_both(tmp_path, corpus_files, cache_dir, backend):
    args = _args(
        tmp_path,
        backend,
        corpus_files,
        cache_dir,
        f"parallel.backend={backend}",
        "train.max_steps=6",
        "monitor.nonfinite=skip",
        "drill.rank=1",
        "drill.nan_grad_step=[3]",
        "drill.grad_tensor=blocks.1.mlp.down.weight",  # in rank 1's half on both backends
        "drill.nan_loss_step=[5]",
        "train.eval_every=0",
        "checkpoint.every=0",
    )
    r0, r1 = run_distributed(skip_on_nan, 2, args)
    assert r0["final"]["skipped_steps"] == r1["final"]["skipped_steps"] == 2
    assert r0["anomalies"] == [3, 5]
    assert r0["tensors"][0] == "blocks.1.mlp.down.weight"  # rank 0 names rank 1's tensor
    assert r0["final"]["fingerprint"] == r1["final"]["fingerprint"]
    assert r0["final"]["loss"] == pytest.approx(r1["final"]["loss"])


def train(args: list[str]) -> dict:
    return run(load_config([], args), read_env())


def test_fsdp_checkpoint_reshards_between_world_sizes(tmp_path, corpus_files, cache_dir):
    two = [
        "parallel.backend=fsdp",
        "train.micro_batch_size=8",
        "checkpoint.every=5",
        "train.eval_every=0",
    ]
    one = [
        "parallel.backend=fsdp",
        "train.micro_batch_size=8",
        "train.grad_accum_steps=2",
        "checkpoint.every=5",
        "train.eval_every=0",
    ]
    # save at 2 ranks, load at 1: the loaded weights are the saved ones, and training continues
    saved = run_distributed(
        train, 2, _args(tmp_path, "a", corpus_files, cache_dir, *two, "train.max_steps=5")
    )[0]
    loaded = run_distributed(
        train, 1, _args(tmp_path, "a", corpus_files, cache_dir, *one, "train.max_steps=5")
    )[0]
    assert loaded["fingerprint"] == saved["fingerprint"]
    continued = run_distributed(
        train, 1, _args(tmp_path, "a", corpus_files, cache_dir, *one, "train.max_steps=8")
    )[0]
    assert continued["step"] == 8 and continued["fingerprint"] != saved["fingerprint"]
    # and the reverse: save at 1, load at 2
    saved = run_distributed(
        train, 1, _args(tmp_path, "b", corpus_files, cache_dir, *one, "train.max_steps=5")
    )[0]
    loaded = run_distributed(
        train, 2, _args(tmp_path, "b", corpus_files, cache_dir, *two, "train.max_steps=5")
    )[0]
    assert loaded["fingerprint"] == saved["fingerprint"]


def test_fsdp_resume_is_bit_exact(tmp_path, corpus_files, cache_dir):
    opts = [
        "parallel.backend=fsdp",
        "train.micro_batch_size=8",
        "train.max_steps=10",
        "train.eval_every=0",
        "checkpoint.every=5",
    ]
    straight = run_distributed(train, 2, _args(tmp_path, "s", corpus_files, cache_dir, *opts))[0]
    run_distributed(
        train, 2, _args(tmp_path, "r", corpus_files, cache_dir, *opts, "train.stop_at_step=5")
    )
    resumed = run_distributed(train, 2, _args(tmp_path, "r", corpus_files, cache_dir, *opts))[0]
    assert resumed["fingerprint"] == straight["fingerprint"]
    check_manifest(tmp_path / "r" / "checkpoints" / "step_00000005", "fsdp")


def check_manifest(checkpoint: Path, backend: str) -> None:
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert manifest["backend"] == backend and manifest["world_size"] == 2
    assert {"rng_rank1.pt", "local_rank1.pt"} <= set(manifest["files"])


def losses(result: dict) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in result["metrics"] if "loss" in m}


ZERO = [
    "parallel.backend=zero",
    "train.micro_batch_size=8",
    "train.eval_every=0",
    "train.log_every=1",
    "checkpoint.every=4",
    "precision.compute_dtype=fp32",  # losses comparable across stages and world sizes
    "train.max_steps=8",
]


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory, corpus_files, cache_dir) -> tuple[Path, dict]:
    """An uninterrupted ZeRO-2 run of 2 ranks, and the same run stopped at its step-4 checkpoint
    (directory `z`), which the tests below resume in three ways."""
    tmp = tmp_path_factory.mktemp("zero-runs")
    straight = run_distributed(train_run, 2, _args(tmp, "s", corpus_files, cache_dir, *ZERO))[0]
    run_distributed(
        train, 2, _args(tmp, "z", corpus_files, cache_dir, *ZERO, "train.stop_at_step=4")
    )
    return tmp, straight


def resume_copy(zero_runs, name: str, world: int, corpus_files, cache_dir, *extra: str) -> dict:
    tmp, _ = zero_runs
    shutil.copytree(tmp / "z", tmp / name)
    args = _args(tmp, name, corpus_files, cache_dir, *ZERO, *extra)
    return run_distributed(train_run, world, args)[0]


def test_zero_resume_is_bit_exact(zero_runs, corpus_files, cache_dir):
    resumed = resume_copy(zero_runs, "same", 2, corpus_files, cache_dir)
    assert resumed["final"]["fingerprint"] == zero_runs[1]["final"]["fingerprint"]
    check_manifest(zero_runs[0] / "z" / "checkpoints" / "step_00000004", "zero")


@pytest.mark.parametrize(
    ("name", "world", "extra"),
    [
        ("stage3", 2, ["parallel.zero_stage=3"]),
        ("one_rank", 1, ["parallel.zero_stage=1", "train.grad_accum_steps=2"]),
    ],
)
def test_zero_checkpoint_resumes_under_another_stage_and_world_size(
    zero_runs, corpus_files, cache_dir, name, world, extra
):
    """ZeRO checkpoints hold fragments by parameter name: a ZeRO-2 checkpoint of 2 ranks resumes
    under ZeRO-3 on 2 ranks and ZeRO-1 on 1 rank (same global batch) with the FP32 weights and
    moments intact: the next steps' losses follow the uninterrupted run (FP32 compute)."""
    resumed = resume_copy(zero_runs, name, world, corpus_files, cache_dir, *extra)
    assert "resume" in [e["kind"] for e in resumed["events"]], name
    before, after = losses(zero_runs[1]), losses(resumed)
    for step in (5, 6, 7, 8):
        assert after[step] == pytest.approx(before[step], rel=1e-3), (name, step)


def snapshot_round_trip(args: list[str]) -> tuple[tuple[str, float], ...]:
    """(fingerprint, logits sum) at a snapshot, two steps later, and after restoring it: the
    restored masters must also reach the weights the next forward computes with."""
    trainer = build_trainer(load_config([], args), read_env())
    inputs = torch.arange(64).reshape(2, 32) % 300
    try:

        def now() -> tuple[str, float]:
            logits = trainer.backend.eval_logits(inputs.to(trainer.device))
            return trainer.backend.fingerprint(), logits.float().sum().item()

        for _ in range(2):
            trainer.train_step()
        snap = trainer.backend.local_state()
        before = now()
        for _ in range(2):
            trainer.train_step()
        moved = now()
        trainer.backend.load_local_state(snap)
        return before, moved, now()
    finally:
        trainer.callbacks.close()
        shutdown(clean=False)


@pytest.mark.parametrize("backend", ["local", "fsdp", "zero2", "zero3"])
def test_snapshot_restores_the_local_shards(tmp_path, corpus_files, cache_dir, backend):
    world = 1 if backend == "local" else 2
    name, stage = {
        "local": ("local", 2),
        "fsdp": ("fsdp", 2),
        "zero2": ("zero", 2),
        "zero3": ("zero", 3),
    }[backend]
    args = _args(
        tmp_path,
        backend,
        corpus_files,
        cache_dir,
        f"parallel.backend={name}",
        f"parallel.zero_stage={stage}",
        "train.eval_every=0",
        "precision.compute_dtype=bf16",
    )
    for before, moved, restored in run_distributed(snapshot_round_trip, world, args):
        assert moved[0] != before[0] and moved[1] != before[1]
        assert restored == before


def zero_clipped_norm(args: list[str]) -> tuple[float, float]:
    """(the monitor's norm, this rank's sum of squares of the gradients DeepSpeed hands to the
    client optimizer at its step calls)."""
    trainer = build_trainer(load_config([], args), read_env())
    try:
        client = trainer.backend.optimizer.optimizer  # bigtrain's AdamW over the flat partitions
        seen = []
        step = client.step

        def spy(*a, **kw):
            grads = [p.grad for group in client.param_groups for p in group["params"]]
            seen.append(sum(float(g.double().square().sum()) for g in grads if g is not None))
            return step(*a, **kw)

        client.step = spy
        result = trainer.train_step()
        # ZeRO-1/2 step one parameter group per call, with only that group's gradients set.
        return float(result.grad_norm), sum(seen)
    finally:
        trainer.callbacks.close()
        shutdown(clean=False)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_steps_on_partitions_clipped_with_the_monitors_norm(
    tmp_path, corpus_files, cache_dir, stage
):
    """bigtrain scales the partitions before DeepSpeed's step (DeepSpeed's own clipping off):
    what the optimizer receives, over both ranks' partitions, has the norm of the threshold.
    BF16 runs stage 1 through DeepSpeed's separate BF16 optimizer."""
    args = _args(
        tmp_path,
        f"z{stage}",
        corpus_files,
        cache_dir,
        "parallel.backend=zero",
        f"parallel.zero_stage={stage}",
        "train.eval_every=0",
        "precision.compute_dtype=bf16",
        "optim.grad_clip=0.01",
    )
    (norm0, sq0), (norm1, sq1) = run_distributed(zero_clipped_norm, 2, args)
    assert norm0 == norm1 and norm0 > 0.1  # the true norm, well above the threshold
    assert (sq0 + sq1) ** 0.5 == pytest.approx(0.01, rel=1e-3)


def test_fingerprint_is_the_same_for_the_same_weights_on_every_backend(
    tmp_path, corpus_files, cache_dir
):
    """Same seed, no step yet: identical weights (model/init.py), so identical fingerprints,
    whatever holds them and however it was built (whole, on meta, inside zero.Init)."""
    prints = {}
    for backend, world, extra in (
        ("local", 1, []),
        ("fsdp", 2, []),
        ("fsdp", 2, ["parallel.meta_init=true"]),
        ("zero", 2, ["parallel.zero_stage=3"]),
        ("zero", 1, ["parallel.zero_stage=3"]),
        ("zero", 2, ["parallel.zero_stage=1", "precision.compute_dtype=bf16"]),
    ):
        args = _args(
            tmp_path,
            f"{backend}{extra}",
            corpus_files,
            cache_dir,
            f"parallel.backend={backend}",
            *extra,
        )
        ranks = run_distributed(initial_fingerprint, world, args)
        assert len(set(ranks)) == 1
        prints[f"{backend}{extra}"] = ranks[0]
    assert len(set(prints.values())) == 1, prints


@pytest.mark.parametrize("backend", ["local", "fsdp"])
def test_activation_checkpointing_keeps_the_losses(tmp_path, corpus_files, cache_dir, backend):
    world = 1 if backend == "local" else 2
    opts = [
        f"parallel.backend={backend}",
        "precision.compute_dtype=fp32",
        "train.max_steps=4",
        "train.eval_every=0",
        "checkpoint.every=0",
    ]
    plain = run_distributed(train, world, _args(tmp_path, "plain", corpus_files, cache_dir, *opts))[
        0
    ]
    ac = run_distributed(
        train,
        world,
        _args(
            tmp_path,
            "ac",
            corpus_files,
            cache_dir,
            *opts,
            "parallel.activation_checkpointing=block",
        ),
    )[0]
    assert ac["fingerprint"] == plain["fingerprint"]  # recomputation is the same arithmetic
