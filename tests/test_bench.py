"""The GPU script's parts that run without a GPU: its syntax, its cache check and its table."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.e2e


def test_gpu_script_parses():
    for script in ("bench/gpu.sh", "bench/gpu_carry.sh"):
        assert subprocess.run(["bash", "-n", script], cwd=ROOT).returncode == 0, script


def test_gpu_cache_check_names_what_is_missing(tmp_path):
    result = subprocess.run(
        [sys.executable, "bench/gpu_data.py", "--check", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert "tiny (vocab 2048)" in result.stderr and "vocab 8192" in result.stderr
    assert str(tmp_path / "corpus-") in result.stderr


def test_gpu_summary_reads_each_steps_json(tmp_path):
    (tmp_path / "llama-1b").mkdir()
    metrics = [{"step": s, "mfu": m, "tokens_per_s": 60000.0} for s, m in ((10, 0.1), (20, 0.5))]
    (tmp_path / "llama-1b" / "metrics.jsonl").write_text("\n".join(json.dumps(m) for m in metrics))
    (tmp_path / "monitor.json").write_text(
        json.dumps({"bandwidth": [{"values": 10**9, "of_flat_sum": 0.8, "kernel_ms": 2.0}]})
    )
    ckpt = {"bytes": 15e9, "sync_s": 30.0, "async_stall_s": 1.5, "ratio": 0.05}
    (tmp_path / "checkpoint.json").write_text(json.dumps({"backends": {"local": ckpt}}))
    (tmp_path / "llama-1b-fp8").mkdir()
    fp8 = [{"step": s, "tokens_per_s": t} for s, t in ((10, 1000.0), (20, 78000.0))]
    (tmp_path / "llama-1b-fp8" / "metrics.jsonl").write_text("\n".join(json.dumps(m) for m in fp8))
    (tmp_path / "mfu.json").write_text(json.dumps({"peak_memory_bytes_by_rank": [40e9]}))
    (tmp_path / "fp8.json").write_text(json.dumps({"peak_memory_bytes_by_rank": [36e9]}))
    (tmp_path / "moe").mkdir()
    moe = [
        {"step": s, "loss": v, "moe_load_max_mean": r, "tokens_per_s": 90000.0}
        for s, v, r in ((10, 7.0, 3.5), (300, 4.5, 1.2))
    ]
    (tmp_path / "moe" / "metrics.jsonl").write_text("\n".join(json.dumps(m) for m in moe))
    (tmp_path / "cp.log").write_text("..\n2 passed, 1 skipped, 16 deselected in 9.1s\n")
    result = subprocess.run(
        [sys.executable, "bench/gpu_data.py", "--summary", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert "50.0% MFU" in result.stdout  # the first interval (compilation) is left out
    # FP8 against the BF16 step's tokens/s, the compiling first interval left out of both
    assert "78,000 tokens/s, 1.30x BF16, peak memory 0.90x" in result.stdout
    assert "1000M 80%" in result.stdout
    assert "async stall 1.50 s (0.050 of sync)" in result.stdout
    assert (
        "moe-tiny: loss 7.00 -> 4.50, busiest expert / mean 1.20, 90,000 tokens/s" in result.stdout
    )
    assert "ring kernels on CUDA vs SDPA: 2 passed, 1 skipped" in result.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    # 2 ms for 1B values -> 2.47 ms for the 1B's gradients, over 16384 tokens at 60k tokens/s
    assert abs(summary["monitor"]["share_of_1b_step_est"] - 2.472e-3 / (16384 / 60000)) < 1e-6
