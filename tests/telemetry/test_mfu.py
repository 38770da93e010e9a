"""MFU arithmetic: model FLOPs per token by hand, data-sheet peaks by device name, the metric."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bigtrain.model import build_model, model_flops_per_token
from bigtrain.parallel.env import DistEnv
from bigtrain.runner import run
from bigtrain.telemetry.mfu import gpu_peak_flops, mfu, resolve_peak_flops


@pytest.mark.unit
def test_flops_per_token_by_hand(micro):
    cfg = micro()
    # micro GPT: 2 layers, d_model 64, GELU d_ff 256, biases, vocab 384 tied, seq 32.
    # per block: qkv 64*192+192, proj 64*64+64, up 64*256+256, down 256*64+64, 2 LayerNorms 2*128
    block = 12480 + 4160 + 16640 + 16448 + 256
    n = 2 * block + 128 + 384 * 64  # + final norm + the tied lm_head's matmul
    attention = 12 * 2 * 64 * 32  # QK^T and AV: 2 matmuls x 2 (fwd) x 3 (fwd+bwd) per layer
    model = build_model(cfg.model, 384)
    assert model_flops_per_token(model, cfg.model) == 6 * n + attention == 797184


@pytest.mark.unit
@pytest.mark.parametrize(
    ("name", "dtype", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989e12),
        ("NVIDIA H100 PCIe", "bf16", 756e12),
        ("NVIDIA H200", "bf16", 989e12),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312e12),
        ("NVIDIA A100-SXM4-40GB", "tf32", 156e12),
        ("Tesla V100-SXM2-32GB", "fp16", 125e12),
        ("Tesla V100-SXM2-32GB", "bf16", None),
        ("NVIDIA GeForce GTX 1080", "fp32", None),
    ],
)
def test_data_sheet_peaks(name, dtype, peak):
    assert gpu_peak_flops(name, dtype) == peak


@pytest.mark.unit
def test_mfu_formula_and_sources():
    assert mfu(1000.0, 797184.0, 1e12, 2) == pytest.approx(1000 * 797184 / 2e12)
    assert resolve_peak_flops(torch.device("cpu"), "bf16", False, 3e12) == (
        3e12,
        "train.peak_flops",
    )
    measured, source = resolve_peak_flops(torch.device("cpu"), "fp32", False, None)
    assert measured > 1e9 and source.startswith("measured")


@pytest.mark.e2e
def test_mfu_in_metrics(micro):
    cfg = micro("train.peak_flops=1e12", "train.max_steps=10")
    run(cfg, DistEnv())
    records = [
        json.loads(line)
        for line in (Path(cfg.train.out_dir) / "metrics.jsonl").read_text().splitlines()
    ]
    logged = [r for r in records if "tokens_per_s" in r]
    assert len(logged) == 2
    for r in logged:
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * 797184 / 1e12, rel=1e-12)
    start = json.loads((Path(cfg.train.out_dir) / "events.jsonl").read_text().splitlines()[0])
    assert start["peak_flops"] == 1e12 and start["flops_per_token"] == 797184
