"""Two pipeline stages against FSDP2 on two ranks: tokens/s on the same model and global batch,
and the measured bubble against the schedule's theoretical one.

Runs, in one invocation, 2 spawned ranks on gloo (CPU) or NCCL (one GPU per rank where there
are two), one thread each: FSDP2 shard 2, then pipeline stages pp=2 under 1F1B and GPipe with
m pipeline micro-batches of `--seqs` sequences each, then the same schedules with 2m micro-batches
(twice the batch). The bubble is read from the time of the schedule itself (the loop's
`forward_backward` part on rank 0, the first stage): a pipeline step of m micro-batches takes
F(m) = (m + pp - 1) t, t one micro-batch's stage time, so t is the slope between m and 2m and the
measured bubble is 1 - m t / F(m); theory says (pp - 1) / (m + pp - 1). What does not grow with m
(the tied table's all-reduce, the schedule's own bookkeeping) counts as bubble here, and a
schedule whose per-micro-batch cost grows with m (GPipe holds every micro-batch's activations)
reads low. Tokens/s is over whole training steps after a warm-up (the monitor, clipping and the
optimizer included).

    python bench/pipeline.py [CONFIG ...] [key=value ...] [--steps N] [--microbatches M]

The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.scaling import BASE, timed  # noqa: E402
from bigtrain.plan.stages import bubble_fraction  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("items", nargs="*", default=[])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--microbatches", type=int, default=4, help="m (default 4)")
    parser.add_argument("--seqs", type=int, default=2, help="sequences per micro-batch")
    args = parser.parse_args()
    files = [i for i in args.items if "=" not in i] or [str(ROOT / "configs" / "tiny.yaml")]
    user = [i for i in args.items if "=" in i]
    out = tempfile.mkdtemp(prefix="bigtrain-pipeline-")
    base = [
        *BASE,
        "eval.sample_every=0",
        "precision.compute_dtype=fp32",
        "monitor.timing_every=1",
        *user,
    ]
    m, seqs = args.microbatches, args.seqs
    results: dict[str, dict] = {}

    def run(name: str, batch: int, extra: list[str]) -> dict:
        overrides = [*base, f"train.out_dir={out}/{name}", f"train.micro_batch_size={batch}"]
        results[name] = run_distributed(timed, 2, files, [*overrides, *extra], args.steps)[0]
        return results[name]

    # FSDP2: each rank takes half of the m x seqs sequences (the same global batch as pp=2's).
    run("fsdp", m * seqs // 2, ["parallel.backend=fsdp"])
    for schedule in ("1f1b", "gpipe"):
        for count in (m, 2 * m):
            run(
                f"pp2_{schedule}_m{count}",
                count * seqs,
                [
                    "parallel.pipeline_parallel=2",
                    f"parallel.pp_schedule={schedule}",
                    f"parallel.pp_microbatches={count}",
                ],
            )
    tokens = {k: r["tokens_per_s"] for k, r in results.items()}
    summary: dict = {
        "bench": "pipeline",
        "steps": args.steps,
        "microbatches": m,
        "seqs_per_microbatch": seqs,
        "machine": f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}",
        "fsdp2_tokens_per_s": tokens["fsdp"],
    }
    print(f"{'run':<16} {'tokens/s':>10} {'vs fsdp x2':>11}")
    for name, value in tokens.items():
        print(f"{name:<16} {value:>10.0f} {value / tokens['fsdp']:>11.3f}")
    for schedule in ("1f1b", "gpipe"):
        t_m = results[f"pp2_{schedule}_m{m}"]["forward_backward_s"]
        t_2m = results[f"pp2_{schedule}_m{2 * m}"]["forward_backward_s"]
        per_micro = (t_2m - t_m) / m
        measured = 1.0 - m * per_micro / t_m
        theory = bubble_fraction(schedule, 2, 1, m)
        print(
            f"{schedule}: bubble measured {measured:.1%}, theory (pp - 1) / (m + pp - 1) {theory:.1%}"
        )
        summary[f"pp2_{schedule}_tokens_per_s"] = tokens[f"pp2_{schedule}_m{m}"]
        summary[f"pp2_{schedule}_vs_fsdp2"] = tokens[f"pp2_{schedule}_m{m}"] / tokens["fsdp"]
        summary[f"pp2_{schedule}_bubble_measured"] = round(measured, 4)
        summary[f"pp2_{schedule}_bubble_theory"] = round(theory, 4)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
