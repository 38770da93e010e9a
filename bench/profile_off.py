"""What profiling costs when it is off: bigtrain's step as it is (the loop marks its phases through
`Trainer.ranges`, empty calls when off) against the same loop without those marks, side by side.

The "before" loop is bigtrain/train/loop.py with every `self.ranges.` line taken out, loaded as
its own module; one trainer runs alternating rounds as either class (the same state, model and
data), so machine noise hits both alike. Also times a profiled window's steps for scale.

    python bench/profile_off.py [CONFIG ...] [key=value ...] [--steps N] [--rounds R]

Prints the step times, the ratio off / before (1.0: no cost) and the marks' own time per step
(timed alone: the part of the ratio that noise cannot hide); the last line is JSON.
"""

from __future__ import annotations

import importlib.util
import json
import platform
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import step_bench  # noqa: E402

from bigtrain.build import build  # noqa: E402
from bigtrain.parallel.env import DistEnv  # noqa: E402
from bigtrain.telemetry.profile import NO_RANGES, PhaseRanges  # noqa: E402
from bigtrain.train import Trainer  # noqa: E402


def trainer_before():
    """bigtrain's Trainer without the profiler range marks (the loop before they existed)."""
    source = (ROOT / "bigtrain" / "train" / "loop.py").read_text()
    stripped, removed = re.subn(r"^[ \t]*self\.ranges\.(begin|end)\(.*\)\n", "", source, flags=re.M)
    assert removed >= 7, f"found {removed} range marks in loop.py"
    path = Path(tempfile.mkdtemp(prefix="bigtrain-bench-")) / "loop_before.py"
    path.write_text(stripped)
    spec = importlib.util.spec_from_file_location("loop_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module.Trainer, removed


def steps(trainer, n: int, marks: bool = True) -> float:
    """n steps as fit() runs them (with its range marks, or without), callbacks included;
    seconds."""
    start = time.perf_counter()
    for _ in range(n):
        result = trainer.train_step()
        trainer.healer.after_step(result)
        trainer.callbacks.on_step_end(trainer, result)
        if marks:
            trainer.ranges.begin("checkpoint_copy")
        trainer.healer.end_step()
        if marks:
            trainer.ranges.end()
    return time.perf_counter() - start


def marks_ns(trainer, num_marks: int, reps: int = 200_000) -> float:
    """Nanoseconds of one step's range marks with profiling off, timed alone: what the step
    ratio measures, without the noise of the step around it."""
    ranges = trainer.ranges
    start = time.perf_counter_ns()
    for _ in range(reps):
        for _ in range(num_marks - 1):
            ranges.begin("data")
        ranges.end()
    loop = time.perf_counter_ns()
    for _ in range(reps):
        for _ in range(num_marks - 1):
            pass
    empty = time.perf_counter_ns()
    return ((loop - start) - (empty - loop)) / reps


def profiled_steps(trainer, n: int) -> float:
    """n steps recorded by torch.profiler (CPU activity), the phases as ranges."""
    trainer.ranges = PhaseRanges()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        seconds = steps(trainer, n)
    trainer.ranges = NO_RANGES
    return seconds


def main() -> None:
    args = step_bench.parse(__doc__.splitlines()[0], "steps per round and loop")
    cfg = step_bench.endless_config(args.items, "wandb.mode=disabled")
    built = build(cfg, DistEnv())
    trainer = built.trainer
    before, num_marks = trainer_before()
    trainer.__class__ = before
    steps(trainer, 3)  # warm-up (allocator, autocast caches)
    t_off, t_before = [], []
    for r in range(args.rounds):  # alternate which goes first, so neither always runs warm
        for cls, times in ((Trainer, t_off), (before, t_before))[:: 1 if r % 2 else -1]:
            trainer.__class__ = cls
            times.append(steps(trainer, args.steps, marks=cls is Trainer))
    trainer.__class__ = Trainer
    mark_ns = marks_ns(trainer, num_marks)
    t_profiled = profiled_steps(trainer, args.steps)
    off, base = float(np.median(t_off)), float(np.median(t_before))
    result = {
        "bench": "profile_off",
        "step_ms_off": 1e3 * off / args.steps,
        "step_ms_before": 1e3 * base / args.steps,
        "ratio_off_before": float(np.median(np.array(t_off) / np.array(t_before))),
        "ratio_per_round": [round(a / b, 4) for a, b in zip(t_off, t_before, strict=True)],
        "marks_ns_per_step": mark_ns,
        "marks_share_of_step": mark_ns * 1e-9 / (base / args.steps),
        "step_ms_profiled": 1e3 * t_profiled / args.steps,
        "range_marks_per_step": num_marks,
        "steps": args.rounds * args.steps,
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}",
    }
    trainer.callbacks.close()
    built.release()
    print(f"profiling off: {result['step_ms_off']:.2f} ms/step")
    print(f"before (no range marks): {result['step_ms_before']:.2f} ms/step")
    print(f"ratio off / before: {result['ratio_off_before']:.4f} (1.0: no cost)")
    print(
        f"the {num_marks} range marks alone: {mark_ns:.0f} ns/step, "
        f"{result['marks_share_of_step']:.2e} of a step"
    )
    print(f"profiled (CPU activity, for scale): {result['step_ms_profiled']:.2f} ms/step")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
