"""Context parallelism: memory per rank and tokens/s by sequence length, cp degree and style,
and the longest sequence that trains within a memory budget at each degree.

For each sequence length (default 1k to 16k tokens) it trains configs/tiny.yaml's model (or the
CONFIGs given) with one sequence per step: cp=1 on one process, then cp=2 (and each of
`--degrees`) on as many spawned ranks (gloo on CPU, one thread each; NCCL with a GPU per rank),
with each of `--styles`. Every run warms up, then times `--steps` training steps. Memory is what
the rank added to its own footprint from before it built the trainer to the peak of training
(host RSS on CPU, the allocator's peak on CUDA): the model, its optimizer states and the
activations, without the interpreter and torch themselves, which a rank pays whatever it trains.
The longest sequence within `--budget-mib` is the longest measured length whose memory stays
under it on every rank (so the lengths' grid bounds the answer: a power of 2 apart).

    python bench/context.py [CONFIG ...] [key=value ...] [--seqs 1024 2048 ...]
        [--degrees 1 2] [--styles ring all_to_all] [--steps N] [--budget-mib M]

A degree that does not divide a length's chunks, or a style the model's heads do not allow, is
left out with its reason. The last line is JSON: `longest_seq` by degree, `tokens_per_s` and
`memory_mib` by style, degree and length.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.scaling import BASE as TIMED  # noqa: E402
from bigtrain.build import build_trainer  # noqa: E402
from bigtrain.config import load_config  # noqa: E402
from bigtrain.errors import ConfigError  # noqa: E402
from bigtrain.parallel.env import read_env, shutdown  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402

BASE = [
    *TIMED,
    "train.micro_batch_size=1",
    "train.grad_accum_steps=1",
    "eval.sample_every=0",
]
"""A timed run's overrides (no sinks, evaluation or checkpoints, no end in sight), one sequence a
step."""


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measured(files: list[str], overrides: list[str], warmup: int, steps: int) -> dict:
    """tokens/s over `steps` training steps after `warmup` ones, and the memory this rank added
    from before the build to its peak (MiB)."""
    cuda = torch.cuda.is_available()
    start = torch.cuda.memory_allocated() if cuda else _rss_bytes()
    cfg = load_config(files, overrides)
    trainer = build_trainer(cfg, read_env())
    try:
        losses = [float(trainer.train_step().loss) for _ in range(warmup)]
        began = time.perf_counter()
        for _ in range(steps):
            losses.append(float(trainer.train_step().loss))
        seconds = time.perf_counter() - began
        if cuda:
            peak = torch.cuda.max_memory_allocated()
        else:  # ru_maxrss: KiB on Linux
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return {
            "tokens_per_s": steps * trainer.tokens_per_step / seconds,
            "memory_mib": (peak - start) / 2**20,
            "losses": losses,
        }
    finally:
        trainer.callbacks.close()
        shutdown(clean=True)


def longest(memory: dict[int, float], budget_mib: float) -> int:
    """The longest length whose memory stays within the budget, each shorter one too (0: none)."""
    best = 0
    for seq in sorted(memory):
        if memory[seq] > budget_mib:
            break
        best = seq
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("items", nargs="*", default=[])
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--degrees", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--styles", nargs="+", default=["ring", "all_to_all"])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--budget-mib", type=float, default=640.0)
    args = parser.parse_args()
    files = [i for i in args.items if "=" not in i] or [str(ROOT / "configs" / "tiny.yaml")]
    user = [i for i in args.items if "=" in i]
    out = tempfile.mkdtemp(prefix="bigtrain-context-")
    table: dict[str, dict[int, dict]] = {}
    skipped: list[str] = []
    for degree in args.degrees:
        for style in args.styles if degree > 1 else ["none"]:
            name = f"cp{degree}" + (f"_{style}" if degree > 1 else "")
            for seq in args.seqs:
                overrides = [
                    *BASE,
                    f"model.seq_len={seq}",
                    f"train.out_dir={out}/{name}-{seq}",
                    *user,
                ]
                if degree > 1:
                    overrides += [
                        "parallel.backend=fsdp",
                        f"parallel.context_parallel={degree}",
                        f"parallel.cp_style={style}",
                    ]
                try:
                    load_config(files, overrides)
                except ConfigError as e:
                    skipped.append(f"{name} seq {seq}: {e}")
                    continue
                ranks = run_distributed(measured, degree, files, overrides, args.warmup, args.steps)
                row = {
                    "tokens_per_s": ranks[0]["tokens_per_s"],
                    "memory_mib": max(r["memory_mib"] for r in ranks),
                }
                table.setdefault(name, {})[seq] = row
                print(
                    f"{name:<16} seq {seq:>6}  {row['tokens_per_s']:>9.0f} tok/s  "
                    f"{row['memory_mib']:>8.0f} MiB/rank",
                    flush=True,
                )
    for line in skipped:
        print("left out:", line)
    by_degree: dict[str, int] = {}
    for name, rows in table.items():
        degree = name.split("_")[0][2:]
        reach = longest({s: r["memory_mib"] for s, r in rows.items()}, args.budget_mib)
        by_degree[degree] = max(by_degree.get(degree, 0), reach)
        print(f"{name}: longest sequence within {args.budget_mib:.0f} MiB per rank: {reach}")
    summary = {
        "bench": "context",
        "machine": f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}",
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "steps": args.steps,
        "budget_mib": args.budget_mib,
        "longest_seq": by_degree,
        "tokens_per_s": {
            n: {s: round(r["tokens_per_s"], 1) for s, r in rows.items()}
            for n, rows in table.items()
        },
        "memory_mib": {
            n: {s: round(r["memory_mib"], 1) for s, r in rows.items()} for n, rows in table.items()
        },
        "left_out": skipped,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
