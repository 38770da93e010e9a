"""The step time with all three metric sinks (wandb, TensorBoard, MLflow) against wandb alone,
side by side: one trainer whose sink logger feeds either wandb alone or all three, in alternating
rounds (the same model, data and records; the machine's noise hits both alike). wandb runs
offline, MLflow on its default SQLite store in the run directory, every step logged by default
(`train.log_every=1`: the sinks' worst case).

    python bench/sinks.py [CONFIG ...] [key=value ...] [--steps N] [--rounds R]

Needs `pip install 'bigtrain[tensorboard,mlflow]'`. Prints ms per step of both arms, the ratio
all three / wandb alone and the sinks' own time per step on the training thread (timed around
their hook: what a busy machine's noise cannot hide; MLflow's logging thread is not in it); the
last line is JSON.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import step_bench  # noqa: E402

from bigtrain.build import build  # noqa: E402
from bigtrain.callbacks.sink_logger import SinkLogger  # noqa: E402
from bigtrain.parallel.env import DistEnv  # noqa: E402


def steps(trainer, n: int) -> float:
    """n steps as fit() runs them, callbacks (the sinks) included; seconds."""
    start = time.perf_counter()
    for _ in range(n):
        result = trainer.train_step()
        trainer.healer.after_step(result)
        trainer.callbacks.on_step_end(trainer, result)
        trainer.healer.end_step()
    return time.perf_counter() - start


class Timed:
    """Seconds spent in the sink logger's step hook (the sinks' own work on the training
    thread), by arm: the part of the step ratio that noise cannot hide."""

    def __init__(self, logger) -> None:
        self.hook, self.seconds = logger.on_step_end, 0.0
        logger.on_step_end = self

    def __call__(self, trainer, result) -> None:
        start = time.perf_counter()
        self.hook(trainer, result)
        self.seconds += time.perf_counter() - start


def main() -> None:
    args = step_bench.parse(__doc__.splitlines()[0], "steps per round and arm")
    os.environ.setdefault("WANDB_SILENT", "true")
    cfg = step_bench.endless_config(
        args.items,
        "wandb.mode=offline",
        "log.sinks=[wandb,tensorboard,mlflow]",
        "train.log_every=1",
    )
    built = build(cfg, DistEnv())
    trainer = built.trainer
    (logger,) = [c for c in trainer.callbacks.items if isinstance(c, SinkLogger)]
    logger.on_start(trainer)  # opens the sinks
    all_sinks = logger.sinks
    wandb_alone = [s for s in all_sinks if s.name == "wandb"]
    steps(trainer, 3)  # warm-up (allocator, autocast caches, the sinks' first writes)
    t_all, t_wandb = [], []
    timed, hook_s = Timed(logger), {"all": 0.0, "wandb": 0.0}
    arms = ((all_sinks, t_all, "all"), (wandb_alone, t_wandb, "wandb"))
    for r in range(args.rounds):  # alternate which arm goes first, so neither always runs warm
        for sinks, times, name in arms[:: 1 if r % 2 else -1]:
            logger.sinks, before = sinks, timed.seconds
            times.append(steps(trainer, args.steps))
            hook_s[name] += timed.seconds - before
    logger.sinks = all_sinks
    med_all, med_wandb = float(np.median(t_all)), float(np.median(t_wandb))
    result = {
        "bench": "sinks",
        "step_ms_all_three": 1e3 * med_all / args.steps,
        "step_ms_wandb_alone": 1e3 * med_wandb / args.steps,
        "ratio_all_wandb": float(np.median(np.array(t_all) / np.array(t_wandb))),
        "ratio_per_round": [round(a / b, 3) for a, b in zip(t_all, t_wandb, strict=True)],
        "sink_ms_per_step_all_three": 1e3 * hook_s["all"] / (args.rounds * args.steps),
        "sink_ms_per_step_wandb_alone": 1e3 * hook_s["wandb"] / (args.rounds * args.steps),
        "log_every": cfg.train.log_every,
        "hold_steps": logger.hold_steps,
        "steps": args.rounds * args.steps,
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}",
    }
    trainer.callbacks.close()
    built.release()
    print(f"wandb alone: {result['step_ms_wandb_alone']:.2f} ms/step")
    print(f"wandb + TensorBoard + MLflow: {result['step_ms_all_three']:.2f} ms/step")
    print(f"ratio all three / wandb alone: {result['ratio_all_wandb']:.3f}")
    print(
        f"the sinks' own time on the training thread: {result['sink_ms_per_step_all_three']:.2f} "
        f"ms/step (all three), {result['sink_ms_per_step_wandb_alone']:.2f} ms/step (wandb alone)"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
