"""ZeRO-3 builds bigtrain's GPT inside deepspeed.zero.Init: no rank ever holds the whole model, and
the initial weights are still exactly those of every other backend."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from bigtrain.build import build_trainer
from bigtrain.checkpoint.sources import InitialValues
from bigtrain.config import load_config
from bigtrain.model import build_model, num_params
from bigtrain.model.init import initial_value
from bigtrain.parallel.backends.zero import is_partitioned
from bigtrain.parallel.env import init_process_group, read_env, shutdown
from bigtrain.parallel.layout import Layout
from bigtrain.parallel.model_setup import make_model
from bigtrain.utils.names import canonical_name
from tests.conftest import micro_overrides
from tests.distributed import run_distributed

pytestmark = pytest.mark.distributed

# 269,096,960 parameters, 1.08 GB in FP32; the largest layers (embedding, MLP up and down) hold
# 16.8M parameters each, 67 MB.
BIG = [
    "model.d_model=2048",
    "model.n_heads=16",
    "model.n_layers=5",
    "model.vocab_size=8192",
    "model.seq_len=256",
    "parallel.backend=zero",
    "parallel.zero_stage=3",
    "precision.compute_dtype=fp32",  # FP32 partitions: exactly half the model's bytes each
]
TINY = ["model.d_model=64", "model.n_heads=2", "model.n_layers=1", "model.vocab_size=64"]


def _kib(key: str) -> int:
    return int(re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)[1])


def _fix_mmap_threshold() -> None:
    """glibc serves allocations of 128 KB..32 MB from its heap once it has seen larger ones freed
    (a dynamic threshold), and keeps what is freed there for reuse: RSS then runs some tens of MB
    above what the build holds. A fixed threshold maps every allocation from 1 MB on and unmaps
    it when freed, so RSS measures the tensors alive."""
    import ctypes

    m_mmap_threshold = -3  # malloc.h
    assert ctypes.CDLL("libc.so.6").mallopt(m_mmap_threshold, 1 << 20) == 1


def _reset_peak() -> int:
    """Reset the high-water mark (VmHWM) to the current RSS, which it returns, in bytes."""
    Path("/proc/self/clear_refs").write_text("5")
    return _kib("VmRSS") * 1024


def _peak_increase(rss_before: int) -> int:
    return _kib("VmHWM") * 1024 - rss_before


def _partitioned_build_and_write(args: list[str]) -> torch.nn.Module:
    """bigtrain's ZeRO-3 build, then the exact initial values read as ZeroBackend reads them, into
    the module's own FP32 partitions (ZeroBackend writes the optimizer's; the optimizer's FP32
    copies and gradient buffers would not fit in this test's budget of half the model)."""
    cfg = load_config([], args)
    layout = Layout.of(
        cfg.parallel, torch.distributed.get_world_size(), torch.distributed.get_rank()
    )
    model, facts = make_model(cfg, layout, cfg.model.vocab_size, torch.device("cpu"))
    assert facts.build_site == "partitioned" and is_partitioned(model)
    initial = InitialValues(model, cfg.train.seed, torch.device("cpu"))
    rank = torch.distributed.get_rank()
    with torch.no_grad():
        for name, p in model.named_parameters():
            size = p.ds_tensor.ds_numel  # rank r holds the r-th slice of ds_numel values
            numel = max(0, min(size, p.ds_numel - rank * size))
            if numel:
                start = rank * size
                p.ds_tensor[:numel].copy_(
                    initial.read(canonical_name(name), "param", start, start + numel)
                )
    return model


def build_peaks(args: list[str]) -> dict:
    _fix_mmap_threshold()
    init_process_group(read_env(), torch.device("cpu"), 600.0, required=True)
    try:
        _partitioned_build_and_write(args + TINY)  # DeepSpeed's imports and setup, not measured
        cfg = load_config([], args)
        with torch.device("meta"):
            shaped = build_model(cfg.model, cfg.model.vocab_size)
        largest = max(p.numel() for p in shaped.parameters()) * 4
        rss = _reset_peak()
        model = _partitioned_build_and_write(args)
        partitioned_peak = _peak_increase(rss)
        # The values landed: this rank's slice of one parameter, checked against its seeded draw.
        p = model.blocks[1].mlp.up.weight
        size = p.ds_tensor.ds_numel
        full = initial_value(model, "blocks.1.mlp.up.weight", p.ds_shape, p.device, cfg.train.seed)
        mine = full.reshape(-1)[torch.distributed.get_rank() * size :][:size]
        written = torch.equal(p.ds_tensor[: mine.numel()], mine)
        rss = _reset_peak()  # the partitioned model stays alive: its pages are not reused
        whole = build_model(cfg.model, cfg.model.vocab_size, init_seed=cfg.train.seed)
        whole_peak = _peak_increase(rss)
        del whole
        return {
            "model_bytes": num_params(shaped) * 4,
            "largest_layer_bytes": largest,
            "partitioned_peak": partitioned_peak,
            "whole_peak": whole_peak,
            "written": written,
        }
    finally:
        shutdown(clean=True)


def test_zero3_build_holds_its_partition_not_the_model(tmp_path, corpus_files, cache_dir):
    args = micro_overrides(tmp_path / "big", corpus_files, cache_dir) + BIG
    ranks = run_distributed(build_peaks, 2, args)
    for rank, r in enumerate(ranks):
        print(
            f"rank {rank}: model {r['model_bytes'] / 2**20:.0f} MiB FP32, largest layer "
            f"{r['largest_layer_bytes'] / 2**20:.0f} MiB; peak RSS increase: zero.Init build + "
            f"initial values {r['partitioned_peak'] / 2**20:.0f} MiB, whole build "
            f"{r['whole_peak'] / 2**20:.0f} MiB"
        )
        assert r["model_bytes"] > 2**30 and r["written"]
        limit = r["model_bytes"] / 2 + 2 * r["largest_layer_bytes"]
        assert r["partitioned_peak"] < limit, (rank, r)
        assert r["whole_peak"] >= r["model_bytes"], (rank, r)


def step0(args: list[str]) -> tuple[str, str, bool]:
    trainer = build_trainer(load_config([], args), read_env())
    try:
        site = trainer.setup.build_site
        return trainer.backend.fingerprint(), site, is_partitioned(trainer.backend.model)
    finally:
        trainer.callbacks.close()
        shutdown(clean=False)


def test_zero3_step0_weights_are_the_local_ones(tmp_path, corpus_files, cache_dir):
    """The whole ZeroBackend, BF16 compute: partitions built in BF16, FP32 masters written
    exactly, so the step-0 fingerprint is the local backend's (FP32 build)."""
    local = run_distributed(step0, 1, micro_overrides(tmp_path / "local", corpus_files, cache_dir))[
        0
    ]
    args = micro_overrides(tmp_path / "zero3", corpus_files, cache_dir) + [
        "parallel.backend=zero",
        "parallel.zero_stage=3",
        "precision.compute_dtype=bf16",
    ]
    zero3 = run_distributed(step0, 2, args)
    assert local[1] == "whole" and zero3[0][1] == zero3[1][1] == "partitioned"
    assert zero3[0][2] and zero3[1][2]
    assert zero3[0][0] == zero3[1][0] == local[0]
