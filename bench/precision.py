"""The same model, data and steps under FP32, BF16, FP16 + loss scaling, and BF16 with FP16
optimizer states, side by side in one process.

    python bench/precision.py [CONFIG ...] [key=value ...] [--steps N] [--variants a,b,...]

One table: tokens/s, bytes/param by component (from the plan, which tests check against measured
storage), final train and validation loss, skipped steps. The last line is JSON.
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
from bigtrain.parallel.env import DistEnv, pick_device  # noqa: E402
from bigtrain.plan.footprint import COMPONENTS, state_bytes  # noqa: E402
from bigtrain.plan.shapes import count_params, meta_model  # noqa: E402
from bigtrain.precision import detect_hardware, resolve_policy  # noqa: E402
from bigtrain.runner import run  # noqa: E402
from bigtrain.store.rundir import read_jsonl  # noqa: E402

VARIANTS = {
    "fp32": ["precision.compute_dtype=fp32"],
    "bf16": ["precision.compute_dtype=bf16"],
    "fp16+loss-scaling": ["precision.compute_dtype=fp16"],
    "bf16+fp16-states": ["precision.compute_dtype=bf16", "precision.optimizer_state_dtype=fp16"],
    "bf16+bf16-states": ["precision.compute_dtype=bf16", "precision.optimizer_state_dtype=bf16"],
}
DEFAULT_VARIANTS = "fp32,bf16,fp16+loss-scaling,bf16+fp16-states"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("items", nargs="*", default=[])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"of {', '.join(VARIANTS)}")
    args = parser.parse_args()
    chosen = args.variants.split(",")
    unknown = [v for v in chosen if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    files = [i for i in args.items if "=" not in i] or [str(ROOT / "configs" / "tiny.yaml")]
    user = [i for i in args.items if "=" in i]
    out = tempfile.mkdtemp(prefix="bigtrain-precision-")
    rows = {}
    for name in chosen:
        extra = VARIANTS[name]
        overrides = [
            "wandb.mode=disabled",
            "train.progress=false",
            f"train.max_steps={args.steps}",
            f"train.eval_every={args.steps}",
            f"train.log_every={args.steps // 3}",
            "checkpoint.every=-1",
            f"train.out_dir={out}/{name}",
            *extra,
            *user,
        ]
        cfg = load_config(files, overrides)
        final = run(cfg, DistEnv())
        metrics = read_jsonl(Path(cfg.train.out_dir) / "metrics.jsonl")
        n, _ = count_params(meta_model(cfg.model, cfg.data))
        policy = resolve_policy(
            cfg.precision, detect_hardware(pick_device(cfg.train.device, DistEnv())), n
        )
        per_param = state_bytes(
            cfg.parallel.backend, cfg.parallel.zero_stage, policy
        ).per_rank_bytes_per_param(1)
        speeds = [m["tokens_per_s"] for m in metrics if "tokens_per_s" in m][
            1:
        ]  # first interval has warm-up
        rows[name] = {
            "tokens_per_s": sum(speeds) / max(1, len(speeds)),
            "bytes_per_param": per_param,
            "train_loss": final["loss"],
            "val_loss": [m["val_loss"] for m in metrics if "val_loss" in m][-1],
            "skipped_steps": final["skipped_steps"],
        }
    head = f"{'variant':<18} {'tokens/s':>9} " + " ".join(
        f"{c.split()[0][:8]:>8}" for c in COMPONENTS
    )
    print(head + f" {'total':>6} {'train':>7} {'val':>7} {'skipped':>7}")
    for name, r in rows.items():
        b = r["bytes_per_param"]
        print(
            f"{name:<18} {r['tokens_per_s']:>9.0f} "
            + " ".join(f"{b[c]:>8.1f}" for c in COMPONENTS)
            + f" {sum(b.values()):>6.1f} {r['train_loss']:>7.3f} {r['val_loss']:>7.3f} {r['skipped_steps']:>7d}"
        )
    print(
        "(bytes/param per component: compute copies, gradients, master weights, optimizer states)"
    )
    vs_bf16 = {}
    if "bf16" in rows:  # the goal for low-precision states: >= 0.95x of BF16's tokens/s
        vs_bf16 = {k: r["tokens_per_s"] / rows["bf16"]["tokens_per_s"] for k, r in rows.items()}
        print("tokens/s vs bf16: " + ", ".join(f"{k} {v:.3f}x" for k, v in vs_bf16.items()))
    print(
        json.dumps(
            {
                "bench": "precision",
                "steps": args.steps,
                "variants": rows,
                "tokens_per_s_vs_bf16": vs_bf16,
                "machine": f"{platform.machine()}, torch {torch.__version__}",
            }
        )
    )


if __name__ == "__main__":
    main()
