"""Sharded against single-process training, side by side on the same global batch.

Runs, in one invocation: 1 process (local backend, all cores), then 2 spawned ranks on gloo with
FSDP2 and with ZeRO-2, then 4 ranks with FSDP2 (shard 4), HSDP (replicate 2 x shard 2) and
tensor parallel 2 x shard 2 (configs/parallel/tp2.yaml; for a `model.kind=hf` Llama-family config
configs/parallel/tp2-hf-llama.yaml) (one thread each, so the cores are split the same way). Each trains the
same model on the same data for the same steps after a warm-up; the timed part is the training
steps only. Prints tokens/s, the ratios to the single process, and how far the FP32 losses of the
sharded runs are from the single process's (a correctness check alongside the speed).

    python bench/scaling.py [CONFIG ...] [key=value ...] [--steps N]

The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bigtrain.build import build_trainer  # noqa: E402
from bigtrain.config import load_config  # noqa: E402
from bigtrain.errors import ConfigError  # noqa: E402
from bigtrain.parallel.env import read_env, shutdown  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402

WARMUP = 3


BASE = [
    "wandb.mode=disabled",
    "train.progress=false",
    "train.eval_every=0",
    "checkpoint.every=-1",
    "train.max_steps=100000",
]
"""Overrides of a timed run: no logging sinks, evaluation or checkpoints, no end in sight."""


def timed(files: list[str], overrides: list[str], steps: int) -> dict:
    """tokens/s over `steps` training steps after a warm-up, every loss, and (with
    monitor.timing_every=1) the mean seconds of the steps' forward_backward part."""
    cfg = load_config(files, overrides)
    trainer = build_trainer(cfg, read_env())
    try:
        losses = []
        for _ in range(WARMUP):
            losses.append(float(trainer.train_step().loss))
        start, forward_backward = time.perf_counter(), 0.0
        for _ in range(steps):
            result = trainer.train_step()
            losses.append(float(result.loss))  # host sync per step, both sides alike
            if result.step_timing is not None:
                forward_backward += result.step_timing["forward_backward"]
        seconds = time.perf_counter() - start
        return {
            "tokens_per_s": steps * trainer.tokens_per_step / seconds,
            "losses": losses,
            "forward_backward_s": forward_backward / steps,
        }
    finally:
        trainer.callbacks.close()
        shutdown(clean=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("items", nargs="*", default=[])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    files = [i for i in args.items if "=" not in i] or [str(ROOT / "configs" / "tiny.yaml")]
    user = [i for i in args.items if "=" in i]
    out = tempfile.mkdtemp(prefix="bigtrain-scaling-")
    base = BASE
    loaded = load_config(files, user)
    micro = loaded.train.micro_batch_size
    if micro % 4:
        raise SystemExit(f"train.micro_batch_size={micro} must divide by 4: 2 and 4 ranks split it")
    runs = [
        ("fsdp", 2, ["parallel.backend=fsdp"], 2),
        ("zero2", 2, ["parallel.backend=zero", "parallel.zero_stage=2"], 2),
        ("fsdp4", 4, ["parallel.backend=fsdp"], 4),
        ("hsdp2x2", 4, ["parallel.backend=fsdp", "parallel.replicate=2"], 4),
    ]
    # a transformers model is split by its layer names (Llama-family ones in this preset)
    preset = "tp2-hf-llama.yaml" if loaded.model.kind == "hf" else "tp2.yaml"
    files_for = {"tp2xdp2": [*files, str(ROOT / "configs" / "parallel" / preset)]}
    try:
        load_config(files_for["tp2xdp2"], user)
        runs.append(("tp2xdp2", 4, [], 2))  # 2 data-parallel ranks split the batch
    except ConfigError as e:
        print(f"tp2xdp2: skipped ({e})")
    results = {}
    for dtype in ("bf16", "fp32"):
        single = timed(
            files,
            [
                *base,
                f"train.out_dir={out}/local-{dtype}",
                f"precision.compute_dtype={dtype}",
                *user,
            ],
            args.steps,
        )
        results[("local", dtype)] = single
        for name, world, extra, dp in runs:
            overrides = [
                *base,
                f"train.out_dir={out}/{name}-{dtype}",
                f"precision.compute_dtype={dtype}",
                *user,
                *extra,
                f"train.micro_batch_size={micro // dp}",
            ]
            run_files = files_for.get(name, files)
            results[(name, dtype)] = run_distributed(
                timed, world, run_files, overrides, args.steps
            )[0]
    summary = {
        "bench": "scaling",
        "steps": args.steps,
        "world_sizes": [2, 4],
        "machine": f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}",
    }
    print(
        f"{'backend':<10} {'dtype':<5} {'tokens/s':>10} {'vs 1 proc':>10} {'max rel loss diff (fp32)':>26}"
    )
    for (name, dtype), r in results.items():
        ref = results[("local", dtype)]
        ratio = r["tokens_per_s"] / ref["tokens_per_s"]
        diff = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref["losses"], strict=True))
        shown = f"{diff:.2e}" if dtype == "fp32" else "-"
        print(f"{name:<10} {dtype:<5} {r['tokens_per_s']:>10.0f} {ratio:>10.3f} {shown:>26}")
        summary[f"{name}_{dtype}_tokens_per_s"] = r["tokens_per_s"]
        summary[f"{name}_{dtype}_ratio"] = ratio
        if dtype == "fp32":
            summary[f"{name}_fp32_max_rel_loss_diff"] = diff
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
