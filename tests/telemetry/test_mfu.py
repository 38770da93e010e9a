"""MFU arithmetic: model FLOPs per token by hand, data-sheet peaks by device name, the metric."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bigtrain.model import build_model, model_flops_per_token
from bigtrain.parallel.env import DistEnv
from bigtrain.runner import run
from bigtrain.telemetry import mfu as mfu_module
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


@pytest.mark.unit
def test_a_cpu_peak_is_measured_once_per_machine_and_kept_in_the_cache(monkeypatch, tmp_path):
    """The first start measures and writes the cache file; a later process (its in-process
    memo empty) reads it without a matmul; another dtype is measured and added beside it; an
    unreadable file is measured again and rewritten."""
    timed = []

    def fake_time(device, dtype, size):
        timed.append(dtype)
        return {torch.float32: 2e11, torch.bfloat16: 5e11}[dtype]

    monkeypatch.setattr(mfu_module, "_time_matmul", fake_time)
    monkeypatch.setattr(mfu_module, "_measured", {})
    cpu = torch.device("cpu")
    peak, source = resolve_peak_flops(cpu, "fp32", False, None, tmp_path)
    assert (peak, timed) == (2e11, [torch.float32])
    assert source.endswith(f"kept in {tmp_path / mfu_module.PEAK_FILE}")
    monkeypatch.setattr(mfu_module, "_measured", {})  # a new process
    assert resolve_peak_flops(cpu, "fp32", False, None, tmp_path)[0] == 2e11
    assert timed == [torch.float32]
    assert resolve_peak_flops(cpu, "bf16", False, None, tmp_path)[0] == 5e11
    kept = json.loads((tmp_path / mfu_module.PEAK_FILE).read_text())
    assert sorted(v["flops"] for v in kept.values()) == [2e11, 5e11]
    assert all(mfu_module.cpu_model() in k and "threads" in k for k in kept)
    (tmp_path / mfu_module.PEAK_FILE).write_text("{not json")
    monkeypatch.setattr(mfu_module, "_measured", {})
    assert resolve_peak_flops(cpu, "fp32", False, None, tmp_path)[0] == 2e11
    assert timed == [torch.float32, torch.bfloat16, torch.float32]
    assert len(json.loads((tmp_path / mfu_module.PEAK_FILE).read_text())) == 1


class MatmulClock:
    """time.perf_counter for the peak's matmuls: the first `slow` of them take `slow_s` (the
    process descheduled beside another), every later one `fast_s`."""

    def __init__(self, slow: int, slow_s: float, fast_s: float) -> None:
        self.slow, self.slow_s, self.fast_s = slow, slow_s, fast_s
        self.now, self.calls, self.durations = 0.0, 0, []

    def perf_counter(self) -> float:
        self.calls += 1
        if self.calls % 2 == 0:  # the end of a matmul
            took = self.slow_s if len(self.durations) < self.slow else self.fast_s
            self.durations.append(took)
            self.now += took
        return self.now


@pytest.mark.unit
def test_a_cpu_peak_measured_beside_a_busy_process_is_its_fastest_matmuls(monkeypatch):
    """Three matmuls descheduled for 60 ms at 256^2 once ended the measurement there (the best
    of 3 over 50 ms reads as an emulated dtype): a peak 30x too low, an MFU 30x too high."""
    clock = MatmulClock(slow=3, slow_s=0.06, fast_s=0.001)
    monkeypatch.setattr(mfu_module, "time", clock)
    peak = mfu_module._time_matmul(torch.device("cpu"), torch.float32, 1024)
    assert peak == pytest.approx(2 * 1024**3 / 0.001)
    assert len(clock.durations) <= 3 * mfu_module.MAX_REPEATS


@pytest.mark.unit
def test_an_emulated_dtype_stops_at_the_first_slow_size(monkeypatch):
    clock = MatmulClock(slow=1000, slow_s=0.1, fast_s=0.1)
    monkeypatch.setattr(mfu_module, "time", clock)
    peak = mfu_module._time_matmul(torch.device("cpu"), torch.float32, 1024)
    assert peak == pytest.approx(2 * 256**3 / 0.1)
    assert len(clock.durations) == mfu_module.MIN_REPEATS  # 0.3 s, not seconds


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
