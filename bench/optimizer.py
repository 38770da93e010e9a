"""bigtrain's AdamW (FP32, BF16 and FP16 states) against torch.optim.AdamW, side by side.

    python bench/optimizer.py [--tensors N] [--total VALUES] [--steps S] [--device cpu|cuda]

The same parameters (N tensors, VALUES values in all, sizes spread like a model's, FP32 gradients)
are stepped by torch's AdamW (foreach, and fused where the device has it) and by
`LowPrecisionAdamW` with each state dtype, in alternating rounds in one process, so the machine's
drift hits all alike. Also counted: host syncs per step of bigtrain's optimizer (calls of
Tensor.item / .cpu / .tolist / __bool__ / __float__ / __int__ during `step()`; goal 0).

The ratio is bigtrain's step time over torch's foreach AdamW on CPU (torch's reference
implementation there) and over torch's fused AdamW on CUDA. Goals: every ratio <= 1.5 on CPU; on a
GPU, FP16 states within 5% of FP32 states in training tokens/s (bench/precision.py). The last line
is JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bigtrain.optim.adamw import LowPrecisionAdamW  # noqa: E402
from bigtrain.utils.syncs import count_host_syncs  # noqa: E402


def model_like_sizes(num_tensors: int, total: int) -> list[int]:
    """A few large matrices, many small vectors (as the monitor bench spreads them)."""
    gen = torch.Generator().manual_seed(0)
    weights = torch.rand(num_tensors, generator=gen) ** 4 + 1e-4
    return (weights / weights.sum() * total).long().clamp(min=1).tolist()


def make_optimizer(kind: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    hyper = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    if kind == "torch_adamw_foreach":
        return torch.optim.AdamW(params, foreach=True, **hyper)
    if kind == "torch_adamw_fused":
        return torch.optim.AdamW(params, fused=True, **hyper)
    dtype = {"fp32_states": torch.float32, "bf16_states": torch.bfloat16}.get(kind, torch.float16)
    return LowPrecisionAdamW(params, state_dtype=dtype, **hyper)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tensors", type=int, default=200)
    ap.add_argument("--total", type=int, default=10_000_000)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per variant and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    sizes = model_like_sizes(args.tensors, args.total)
    kinds = ["torch_adamw_foreach", "fp32_states", "bf16_states", "fp16_states"]
    if device.type == "cuda" or hasattr(torch, "_fused_adamw_"):
        kinds.insert(1, "torch_adamw_fused")
    gen = torch.Generator().manual_seed(1)
    grads = [(torch.randn(n, generator=gen) * 1e-3).to(device) for n in sizes]
    setups = {}
    for kind in kinds:
        params = [torch.nn.Parameter(torch.randn(n, generator=gen).to(device)) for n in sizes]
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        opt = make_optimizer(kind, params)
        opt.step()  # states exist, kernels compiled
        setups[kind] = opt
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(args.rounds):
        for kind, opt in setups.items():
            sync()
            start = time.perf_counter()
            for _ in range(args.steps):
                opt.step()
            sync()
            times[kind].append((time.perf_counter() - start) / args.steps * 1e3)
    step_ms = {k: min(v) for k, v in times.items()}
    reference = "torch_adamw_fused" if device.type == "cuda" else "torch_adamw_foreach"
    ours = ["fp32_states", "bf16_states", "fp16_states"]
    syncs = {k: count_host_syncs(setups[k].step) for k in ours}
    print(
        f"{args.tensors} tensors, {sum(sizes) / 1e6:.1f}M values, {device}; best of {args.rounds}"
    )
    for kind in kinds:
        ratio = step_ms[kind] / step_ms[reference]
        print(f"  {kind:20s} {step_ms[kind]:8.2f} ms/step  {ratio:5.2f}x {reference}")
    print(json.dumps({
        "bench": "optimizer",
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "tensors": args.tensors,
        "values": sum(sizes),
        "reference": reference,
        "step_ms": {"torch_adamw": step_ms[reference], **{k: step_ms[k] for k in kinds}},
        "ratio_vs_torch": {k: step_ms[k] / step_ms[reference] for k in ours},
        "host_syncs_per_step": syncs,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
