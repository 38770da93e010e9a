"""Model FLOPs utilisation: model FLOPs per token x tokens/s over the devices' peak.

MFU counts the model's FLOPs (forward + backward, attention included; see gpt.flops_per_token),
not the hardware's: recomputation under activation checkpointing is not credited, so turning it
on lowers MFU by what it costs. The peak is the dense tensor-core peak of the device in the
compute dtype (no 2:4 sparsity), from the vendors' data sheets; on a CPU it is measured with a
large matmul in the compute dtype (a practical peak, not a theoretical one), once per machine:
the number is kept in the cache root (PEAK_FILE) for every later run. `train.peak_flops`
overrides either.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# Dense peak FLOP/s per GPU by compute dtype (NVIDIA data sheets; FP32 without TF32).
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "V100": {"fp16": 125e12, "fp32": 15.7e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12, "tf32": 156e12},
    "H100 PCIe": {"bf16": 756e12, "fp16": 756e12, "fp32": 51e12, "tf32": 378e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12, "tf32": 494e12},  # SXM
    "H200": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12, "tf32": 494e12},
}


def gpu_peak_flops(device_name: str, dtype: str) -> float | None:
    """The data-sheet peak of a GPU by its CUDA name (e.g. 'NVIDIA H100 80GB HBM3'), or None."""
    name = device_name.upper()
    # Longest key first: "H100 PCIe" before "H100".
    for key in sorted(PEAK_FLOPS, key=len, reverse=True):
        if all(part in name for part in key.upper().split()):
            return PEAK_FLOPS[key].get(dtype)
    return None


_measured: dict[tuple[str, torch.dtype], float] = {}

PEAK_FILE = "cpu_peak_flops.json"
"""In the cache root (data.cache_dir, $BIGTRAIN_CACHE or ~/.cache/bigtrain): the measured peaks
of this machine's CPU, by CPU model, dtype, thread count and torch version."""


def measure_matmul_flops(
    device: torch.device, dtype: torch.dtype, size: int = 1024, cache_dir: Path | None = None
) -> float:
    """FLOP/s of the best of a few square matmuls in `dtype` (the practical peak of a CPU).
    Measured once per process and device type; with `cache_dir`, once per machine: the number is
    kept in its PEAK_FILE, so every run on the machine compares on the same peak, and a start
    does not spend ~0.25 s of matmuls on each rank."""
    key = (device.type, dtype)
    if key not in _measured:
        stored = _stored_peaks(cache_dir) if cache_dir is not None else {}
        name = _peak_key(dtype)
        if name in stored:
            _measured[key] = stored[name]
        else:
            _measured[key] = _time_matmul(device, dtype, size)
            if cache_dir is not None:
                _store_peak(cache_dir, name, _measured[key])
    return _measured[key]


def _peak_key(dtype: torch.dtype) -> str:
    return (
        f"{cpu_model()} | {dtype} | {torch.get_num_threads()} threads | torch {torch.__version__}"
    )


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), or the platform's processor string."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _stored_peaks(cache_dir: Path) -> dict[str, float]:
    """The peaks kept in cache_dir; empty when there is no file or it cannot be read (then the
    peak is measured again and the file written anew)."""
    with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
        peaks = json.loads((cache_dir / PEAK_FILE).read_text())
        return {k: float(v["flops"]) for k, v in peaks.items()}
    return {}


def _store_peak(cache_dir: Path, name: str, flops: float) -> None:
    """Adds one peak to the file, written whole under a temporary name and renamed (ranks that
    measure at once each leave a complete file). A cache that cannot be written is logged:
    the next start measures again."""
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        path = cache_dir / PEAK_FILE
        peaks = {}
        with contextlib.suppress(OSError, ValueError):
            peaks = json.loads(path.read_text())
        if not isinstance(peaks, dict):
            peaks = {}
        peaks[name] = {"flops": flops, "measured": time.strftime("%Y-%m-%dT%H:%M:%S")}
        tmp = path.with_name(f".{PEAK_FILE}.{os.getpid()}")
        tmp.write_text(json.dumps(peaks, indent=1, sort_keys=True) + "\n")
        tmp.replace(path)
    except OSError as e:
        logger.info("the measured CPU peak is not kept (%s): the next start measures again", e)


SLOW_S = 0.05  # the fastest matmul of a size takes longer: the dtype is emulated, stop there
MIN_REPEATS, MAX_REPEATS, BUDGET_S = 3, 20, 0.25


def _time_matmul(device: torch.device, dtype: torch.dtype, size: int) -> float:
    """Square matmuls of growing size up to `size`, stopping early where the fastest one takes
    over SLOW_S: a dtype the CPU only emulates (BF16 without AVX512-BF16/AMX) would otherwise
    cost seconds per process for a number that says only that it is slow."""
    n = min(256, size)
    while True:
        final = n >= size
        flops, seconds = _best_matmul(device, dtype, n, enough_s=0.0 if final else SLOW_S)
        if final or seconds > SLOW_S:
            return flops
        n = min(2 * n, size)


def _best_matmul(
    device: torch.device, dtype: torch.dtype, n: int, enough_s: float
) -> tuple[float, float]:
    """(FLOP/s, seconds) of the fastest of MIN_REPEATS to MAX_REPEATS matmuls of size n,
    repeated for up to BUDGET_S until one takes `enough_s` or less (0: the whole budget). On a
    machine shared with other processes (replica groups starting beside each other, another
    job) a few calls can all be descheduled: the best of 3 was once 30x below the CPU's peak,
    and every MFU against it as much too high."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b  # warm-up: thread pools, kernels
    best, spent, repeats = float("inf"), 0.0, 0
    while repeats < MIN_REPEATS or (repeats < MAX_REPEATS and spent < BUDGET_S and best > enough_s):
        started = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # host sync: timing only, at setup
        seconds = time.perf_counter() - started
        best, spent, repeats = min(best, seconds), spent + seconds, repeats + 1
    return 2 * n**3 / best, best


def resolve_peak_flops(
    device: torch.device,
    compute_dtype: str,
    allow_tf32: bool,
    configured: float | None,
    cache_dir: Path | None = None,
) -> tuple[float | None, str]:
    """(peak FLOP/s of one device, where the number comes from); a CPU's measured peak is kept
    in `cache_dir` (measure_matmul_flops)."""
    if configured:
        return configured, "train.peak_flops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        dtype = "tf32" if compute_dtype == "fp32" and allow_tf32 else compute_dtype
        peak = gpu_peak_flops(name, dtype)
        if peak is None:
            return None, f"no data-sheet peak for {name} in {dtype}: set train.peak_flops"
        return peak, f"data sheet: {name}, dense {dtype}"
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    peak = measure_matmul_flops(device, dtypes[compute_dtype], cache_dir=cache_dir)
    kept = f", kept in {cache_dir / PEAK_FILE}" if cache_dir is not None else ""
    return peak, f"measured: 1024^3 {compute_dtype} matmul on this CPU{kept}"


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float, num_devices: int) -> float:
    """Model FLOPs utilisation of `num_devices` devices processing `tokens_per_s` (all of them)."""
    return tokens_per_s * flops_per_token / (peak_flops * num_devices)
