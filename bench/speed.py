"""Each speed option on and off, side by side: tokens/s, MFU and (on CUDA) peak memory.

    python bench/speed.py [CONFIG ...] [key=value ...] [--steps N] [--only NAME ...]

Variants (each against `plain`: no compile, no activation checkpointing, foreach AdamW, no
read-ahead): torch.compile of the blocks, activation checkpointing per block and selective, fused
AdamW, data read-ahead, everything on at once (`all`), and on CUDA the batches without pinned
memory (`plain` has them pinned there). Each trains the same model on the same data for N steps
in this process; tokens/s is the mean over the logged intervals after the first (which holds
compilation and warm-up). MFU uses the model's FLOPs per token (recomputation not credited) over
the device's peak (data sheet or a measured matmul on CPU). The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bigtrain.config import load_config  # noqa: E402
from bigtrain.parallel.env import DistEnv  # noqa: E402
from bigtrain.runner import run  # noqa: E402
from bigtrain.store.rundir import read_jsonl  # noqa: E402

PLAIN = [
    "parallel.compile=false",
    "parallel.activation_checkpointing=none",
    "optim.fused=false",
    "data.prefetch=0",
]
VARIANTS = {
    "plain": [],
    "compile": ["parallel.compile=true"],
    "checkpoint block": ["parallel.activation_checkpointing=block"],
    "checkpoint selective": ["parallel.activation_checkpointing=selective"],
    "fused adamw": ["optim.fused=true"],
    "read-ahead": ["data.prefetch=2"],
    "all": [
        "parallel.compile=true",
        "parallel.activation_checkpointing=selective",
        "optim.fused=true",
        "data.prefetch=2",
    ],
}


if torch.cuda.is_available():
    # data.pin_memory is on by default with CUDA (and refused without it): measure it off.
    VARIANTS["unpinned batches"] = ["data.pin_memory=false"]


def measure(files: list[str], overrides: list[str]) -> dict:
    cfg = load_config(files, overrides)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    final = run(cfg, DistEnv())
    metrics = [m for m in read_jsonl(Path(cfg.train.out_dir) / "metrics.jsonl") if "mfu" in m]
    later = metrics[1:] or metrics
    out = {
        "tokens_per_s": sum(m["tokens_per_s"] for m in later) / len(later),
        "mfu": sum(m["mfu"] for m in later) / len(later),
        "loss": final["loss"],
    }
    if torch.cuda.is_available():
        out["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("items", nargs="*", default=[])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--only", nargs="*", default=None, help="variant names to run")
    args = parser.parse_args()
    files = [i for i in args.items if "=" not in i] or [str(ROOT / "configs" / "tiny.yaml")]
    user = [i for i in args.items if "=" in i]
    out = tempfile.mkdtemp(prefix="bigtrain-speed-")
    names = ["plain"] + [n for n in VARIANTS if n != "plain" and (not args.only or n in args.only)]
    rows = {}
    for name in names:
        overrides = [
            "wandb.mode=disabled",
            "train.progress=false",
            f"train.max_steps={args.steps}",
            "train.eval_every=0",
            f"train.log_every={max(1, args.steps // 4)}",
            "checkpoint.every=-1",
            f"train.out_dir={out}/{name.replace(' ', '-')}",
            *PLAIN,
            *VARIANTS[name],
            *user,
        ]
        rows[name] = measure(files, overrides)
    base = rows["plain"]
    print(f"{'variant':<22} {'tokens/s':>9} {'vs plain':>9} {'MFU':>7} {'loss':>8} {'peak MB':>8}")
    for name, r in rows.items():
        r["vs_plain"] = r["tokens_per_s"] / base["tokens_per_s"]
        peak = (
            f"{r['peak_memory_bytes'] / 2**20:>8.0f}" if "peak_memory_bytes" in r else f"{'-':>8}"
        )
        print(
            f"{name:<22} {r['tokens_per_s']:>9.0f} {r['vs_plain']:>9.3f} {r['mfu']:>7.2%} "
            f"{r['loss']:>8.4f} {peak}"
        )
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor()
    print(
        json.dumps(
            {
                "bench": "speed",
                "steps": args.steps,
                "variants": rows,
                "device": device or platform.machine(),
                "machine": f"{platform.machine()}, torch {torch.__version__}",
            }
        )
    )


if __name__ == "__main__":
    main()
