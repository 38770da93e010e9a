"""The monitor on 2-rank FSDP2 and ZeRO-2/3 shards sees what it sees on the unsharded model."""

from __future__ import annotations

from pathlib import Path

import pytest

from bigtrain.build import build_trainer
from bigtrain.config import load_config
from bigtrain.parallel.env import read_env, shutdown
from tests.conftest import micro_overrides
from tests.distributed import run_distributed

pytestmark = pytest.mark.distributed

CORRUPTED = "blocks.1.attn.k.weight"


def first_step_stats(args: list[str]) -> dict:
    """Backward of the first step, then the monitor's reduced per-tensor statistics."""
    trainer = build_trainer(load_config([], args), read_env())
    try:
        backend, monitor = trainer.backend, trainer.monitor
        batches = trainer.loader.next_step()
        monitor.begin(1)  # the checksums' expected side from this step's forwards
        losses = [
            backend.forward_backward(x, y, i, len(batches)) for i, (x, y) in enumerate(batches)
        ]
        import torch

        loss = torch.stack(losses).mean()
        health = monitor.check(backend.named_grads(), loss, backend.unscale_grads(), full=True)
        faulty = None
        if monitor.checksums is not None:  # x10 in the last rank's shard of one tensor
            named = dict(backend.named_grads())
            if read_env().rank == read_env().world_size - 1:
                named[CORRUPTED].mul_(10.0)
            faulty = monitor.check(list(named.items()), loss, 1.0, full=False).checksums
        return {
            "checksums": health.checksums,
            "checksums_faulty": faulty,
            "checksum_record": monitor.checksum_record(),
            "names": health.stats.names,
            "max_abs": health.host_max_abs,
            "sum_sq": health.stats.sum_sq.tolist(),
            "loss": health.host_loss,
            "norm": health.host_grad_norm,
            "local_numel": sum(g.numel() for _, g in backend.named_grads()),
        }
    finally:
        trainer.callbacks.close()
        shutdown(clean=False)


def _args(tmp: Path, name: str, corpus_files, cache_dir, *extra: str) -> list[str]:
    return micro_overrides(tmp / name, corpus_files, cache_dir) + [
        "train.eval_every=0",
        "checkpoint.every=0",
        "precision.compute_dtype=fp32",
        *extra,
    ]


@pytest.fixture(scope="module")
def unsharded(tmp_path_factory, corpus_files, cache_dir):
    tmp = tmp_path_factory.mktemp("unsharded")
    return first_step_stats(
        _args(tmp, "local", corpus_files, cache_dir, "train.micro_batch_size=16")
    )


@pytest.mark.parametrize("backend", ["fsdp", "zero2", "zero3"])
def test_sharded_stats_equal_the_unsharded_model(
    tmp_path, corpus_files, cache_dir, unsharded, backend
):
    extra = ["parallel.backend=fsdp"] if backend == "fsdp" else ["parallel.backend=zero"]
    if backend.startswith("zero"):
        extra.append(f"parallel.zero_stage={backend[-1]}")
    args = _args(tmp_path, backend, corpus_files, cache_dir, "train.micro_batch_size=8", *extra)
    r0, r1 = run_distributed(first_step_stats, 2, args)
    assert r0["names"] == r1["names"] == unsharded["names"]
    # Identical on every rank, bit for bit: both ranks take the same decisions.
    for key in ("max_abs", "sum_sq", "loss", "norm"):
        assert r0[key] == r1[key], key
    # Each rank read only its shards: about half the parameters each.
    total = r0["local_numel"] + r1["local_numel"]
    assert 0.4 * total <= r0["local_numel"] <= 0.6 * total
    assert r0["loss"] == pytest.approx(unsharded["loss"], rel=1e-5)
    assert r0["norm"] == pytest.approx(unsharded["norm"], rel=1e-4)
    for name, a, b in zip(r0["names"], r0["max_abs"], unsharded["max_abs"], strict=True):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-9), f"{name}: max |g|"
    for name, a, b in zip(r0["names"], r0["sum_sq"], unsharded["sum_sq"], strict=True):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-12), f"{name}: sum of squares"
    if backend.startswith("zero"):  # DeepSpeed's flat partitions: off, and the start says so
        assert r0["checksums"] is None and r0["checksum_record"]["checksums"] == "off"
        assert "parallel.backend=zero" in r0["checksum_record"]["reason"]
        return
    # Gradient checksums: every tensor checked on its shards' rows, identical on both ranks;
    # FP32 rounding far below the tolerance; x10 in one rank's rows of one tensor is 0.9.
    names = r0["names"]
    assert r0["checksum_record"] == {"checksums": len(names), "unchecked": []}
    for run in (r0, unsharded):
        assert max(run["checksums"]) < 1e-4 and len(run["checksums"]) == len(names)
    assert r0["checksums_faulty"] == r1["checksums_faulty"]
    faulty = dict(zip(names, r0["checksums_faulty"], strict=True))
    assert faulty.pop(CORRUPTED) == pytest.approx(0.9, abs=1e-4)
    assert max(faulty.values()) < 1e-4
    whole = dict(zip(names, unsharded["checksums_faulty"], strict=True))
    assert whole[CORRUPTED] == pytest.approx(0.9, abs=1e-4)  # one process: the whole tensor
