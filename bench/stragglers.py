"""Straggler detection, measured: false alarms on healthy 2-rank runs, slow ranks named.

    python bench/stragglers.py [--quick] [--seeds 1,2] [--runs N] [--steps 100] [--every 2]
                               [--slow-runs K] [--slowdowns 1.5,2]

1. Healthy sweep: the runs of bench/detection.py's healthy matrix (detection_runs.matrix: seeds x
   FP32/BF16 x GPT-2/Llama style x two corpora x LR 1x/2x; --quick: the micro model, seed 1, 16
   runs), each as a real FSDP2 run on 2 gloo ranks (one process and one thread per rank), no
   fault, every `--every` steps a timing step (monitor.timing_every). Every `straggler` event is
   a false alarm.
2. Slow ranks: the first `--slow-runs` runs again with rank 1 sleeping in every forward+backward
   (drill.slow_rank=1) for (slowdown - 1) x the healthy run's median forward+backward, so that its
   forward+backward takes `slowdown` x rank 0's. A timing step detects when it names rank 1's
   forward_backward; any other name there is a false alarm too.
3. Rules on the recorded timings: every rule below sees the same per-rank times the runs' own
   StragglerReport gathered (metrics.jsonl's step_time_by_rank), the run's own rule among them,
   and the rule before issue 49 (a rank against the median of all ranks, itself included).

`--every 2` (default): the step after a timing step is never one, so its `other` (the previous
step's callbacks) never holds the metrics write that rank 0 alone does on timing steps. Judging
every other step measures the rule on 25x as many timing steps as the default 50 would, and
consecutive timing steps 2 steps apart share a noisy neighbour's bursts more than steps 50 apart
do, so a rule that needs several timing steps in a row is, if anything, harder on itself here.

Measured on 2 CPU cores shared with other jobs (load 6-12): --quick took 5-6 minutes, --seeds 1
(configs/tiny.yaml) 32; the numbers are in docs/healing.md (Stragglers). `--save-timings FILE`
keeps the recorded times, `--from-timings FILE` judges the rules on them again without runs.

The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from detection_runs import TINY, RunSpec, matrix, read_events  # noqa: E402

from bigtrain.build import build_trainer  # noqa: E402
from bigtrain.callbacks.straggler import (  # noqa: E402
    CONSECUTIVE,
    JUDGED,
    MIN_EXCESS_S,
    MIN_SHARE,
    Streaks,
    find_stragglers,
)
from bigtrain.config import load_config  # noqa: E402
from bigtrain.config.schema import MonitorConfig  # noqa: E402
from bigtrain.parallel.env import free_port, read_env, shutdown  # noqa: E402
from bigtrain.train.timing import PARTS  # noqa: E402

RANKS = 2
SLOW_RANK = 1


@dataclass
class Run:
    """One real 2-rank run: its per-rank parts at every timing step and its straggler events."""

    name: str
    slowdown: float  # 1: healthy
    slow_s: float
    timings: list[dict] = field(default_factory=list)  # {"step", "by_rank": [{part: s}]}
    events: list[dict] = field(default_factory=list)
    seconds: float = 0.0


def job(spec: RunSpec, out_dir: str, every: int, slow_s: float) -> list[str]:
    args = spec.overrides(out_dir, world_size=RANKS) + [f"monitor.timing_every={every}"]
    if slow_s > 0:
        args += [f"drill.slow_rank={SLOW_RANK}", f"drill.slow_s={slow_s:.4f}"]
    return args


def run_all(jobs: list[list[str]], out_root: str) -> None:
    """The jobs as real FSDP2 runs on RANKS spawned gloo processes, one after the other in one
    process group (started once)."""
    context = mp.start_processes(
        _rank_main,
        args=(str(free_port()), jobs, out_root),
        nprocs=RANKS,
        start_method="spawn",
        join=False,
    )
    while not context.join():
        pass


def _rank_main(rank: int, port: str, jobs: list[list[str]], out_root: str) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(RANKS), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1"
    )
    os.environ["MASTER_PORT"] = port
    torch.set_num_threads(1)  # RANKS processes on as many cores
    for args in jobs:
        started = time.perf_counter()
        trainer = build_trainer(load_config([TINY], args), read_env())
        try:
            trainer.fit(resumed=False)
        finally:
            trainer.callbacks.close()
        if rank == 0:
            out_dir = next(a.split("=", 1)[1] for a in args if a.startswith("train.out_dir="))
            (Path(out_dir) / "bench_seconds").write_text(str(time.perf_counter() - started))
    shutdown(clean=True)


def collect(run: Run, out_dir: str) -> Run:
    metrics = [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").open()]
    for m in metrics:
        if "step_time_by_rank" in m:
            parts = m["step_time_by_rank"]
            by_rank = [{p: parts[p][r] for p in parts} for r in range(RANKS)]
            run.timings.append({"step": m["step"], "by_rank": by_rank})
    run.events = [e for e in read_events(out_dir) if e["kind"] == "straggler"]
    run.seconds = float((Path(out_dir) / "bench_seconds").read_text())
    return run


def median_forward_backward(run: Run) -> float:
    return statistics.median(
        t["by_rank"][r]["forward_backward"] for t in run.timings for r in range(RANKS)
    )


def realised_ratio(run: Run) -> float:
    """The median over timing steps of rank 1's forward+backward / rank 0's."""
    return statistics.median(
        t["by_rank"][SLOW_RANK]["forward_backward"] / max(t["by_rank"][0]["forward_backward"], 1e-9)
        for t in run.timings
    )


def before_issue_49(by_rank: list[dict[str, float]], factor: float) -> list[tuple[int, str]]:
    """The rule before issue 49: a rank against the median of all ranks, itself included."""
    found = []
    for part in JUDGED:
        values = [times[part] for times in by_rank]
        median = statistics.median(values)
        for rank, value in enumerate(values):
            if value > factor * median and value - median >= MIN_EXCESS_S:
                found.append((rank, part))
    return found


@dataclass(frozen=True)
class Rule:
    factor: float
    min_share: float = MIN_SHARE
    consecutive: int = CONSECUTIVE
    with_self: bool = False  # the rule before issue 49


def rules(configured: MonitorConfig) -> dict[str, Rule]:
    """name -> rule; the configured one (monitor.straggler_factor, the module's floor and
    repeat) first, then the one before issue 49, then its neighbours."""
    out = {
        "configured": Rule(configured.straggler_factor),
        "before: median with itself x1.3": Rule(1.3, 0.0, 1, with_self=True),
        "others x1.3, 10 ms, 1 step": Rule(1.3, 0.0, 1),
    }
    for factor in (1.3, 1.5):
        for share in (0.1, 0.2):
            for consecutive in (1, 2, 3):
                out[f"others x{factor}, {share:.0%} of step, {consecutive} in a row"] = Rule(
                    factor, share, consecutive
                )
    return out


def judge(run: Run, rule: Rule) -> list[set[tuple[int, str]]]:
    """Per timing step of the run, the (rank, part) pairs the rule names there."""
    streaks, named = Streaks(rule.consecutive), []
    for timing in run.timings:
        if rule.with_self:
            found = before_issue_49(timing["by_rank"], rule.factor)
        else:
            by_rank = [{p: times[p] for p in PARTS} for times in timing["by_rank"]]
            found = [
                (s["member"], s["part"])
                for s in find_stragglers(by_rank, rule.factor, MIN_EXCESS_S, rule.min_share)
            ]
        named.append(streaks.update(found))
    return named


def score(healthy: list[Run], slow: list[Run], rule: Rule) -> dict:
    judged = sum(len(r.timings) for r in healthy)
    alarms = [sum(1 for names in judge(r, rule) if names) for r in healthy]
    out = {
        "false_alarm_steps": sum(alarms),
        "false_alarms_per_1k": round(1000 * sum(alarms) / max(judged, 1), 2),
        "healthy_runs_with_alarm": sum(1 for a in alarms if a),
    }
    for slowdown in sorted({r.slowdown for r in slow}):
        named = detected = wrong = 0
        first = []
        for run in (r for r in slow if r.slowdown == slowdown):
            verdicts = judge(run, rule)
            named += len(verdicts)
            hits = [(SLOW_RANK, "forward_backward") in v for v in verdicts]
            detected += sum(hits)
            wrong += sum(1 for v in verdicts if v - {(SLOW_RANK, "forward_backward")})
            first.append(hits.index(True) + 1 if any(hits) else None)
        key = f"x{slowdown:g}"
        out[f"detected_{key}"] = round(detected / max(named, 1), 3)
        out[f"runs_named_{key}"] = sum(1 for f in first if f is not None)
        out[f"first_timing_step_{key}"] = first
        out[f"wrong_names_{key}"] = wrong
    return out


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="micro model, seed 1")
    ap.add_argument("--seeds", default=None, help="comma-separated (default 1,2; --quick: 1)")
    ap.add_argument("--runs", type=int, default=None, help="only the matrix's first N runs")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--every", type=int, default=2, help="monitor.timing_every of every run")
    ap.add_argument("--slow-runs", type=int, default=4, help="runs repeated with a slow rank")
    ap.add_argument("--slowdowns", default="1.5,2", help="rank 1's forward+backward / rank 0's")
    ap.add_argument("--save-timings", type=Path, default=None, metavar="FILE", help="json")
    ap.add_argument("--from-timings", type=Path, default=None, metavar="FILE", help="no runs")
    args = ap.parse_args()
    args.seeds = [int(s) for s in (args.seeds or ("1" if args.quick else "1,2")).split(",")]
    args.slowdowns = [float(s) for s in args.slowdowns.split(",")]
    return args


def sweep(args: argparse.Namespace) -> tuple[list[Run], list[Run]]:
    """The healthy runs, then the slow-rank runs (the real ones, or --from-timings)."""
    if args.from_timings is not None:
        saved = json.loads(args.from_timings.read_text())
        return [Run(**r) for r in saved["healthy"]], [Run(**r) for r in saved["slow"]]
    specs = matrix(args.seeds, args.quick, args.steps)[: args.runs]
    with tempfile.TemporaryDirectory() as out_root:
        dirs = [str(Path(out_root) / f"healthy-{i}") for i in range(len(specs))]
        print(f"healthy: {len(specs)} runs of {args.steps} steps on {RANKS} ranks", flush=True)
        run_all([job(s, d, args.every, 0.0) for s, d in zip(specs, dirs, strict=True)], out_root)
        healthy = [collect(Run(s.name, 1.0, 0.0), d) for s, d in zip(specs, dirs, strict=True)]
        for run in healthy:
            print(
                f"  {run.name:<42} {run.seconds:5.1f} s  forward+backward "
                f"{median_forward_backward(run) * 1e3:6.1f} ms  straggler events {len(run.events)}",
                flush=True,
            )
        slow_jobs, slow = [], []
        for i, (spec, base) in enumerate(zip(specs[: args.slow_runs], healthy, strict=False)):
            for slowdown in args.slowdowns:
                slow_s = (slowdown - 1) * median_forward_backward(base)
                out_dir = str(Path(out_root) / f"slow-{i}-x{slowdown:g}")
                slow_jobs.append(job(spec, out_dir, args.every, slow_s))
                slow.append((Run(spec.name, slowdown, slow_s), out_dir))
        if slow_jobs:
            print(f"slow rank: {len(slow_jobs)} runs", flush=True)
            run_all(slow_jobs, out_root)
        slow = [collect(run, out_dir) for run, out_dir in slow]
        for run in slow:
            ratio = realised_ratio(run)
            print(
                f"  {run.name:<42} x{run.slowdown:g} (sleep {run.slow_s * 1e3:.0f} ms): rank 1 / "
                f"rank 0 forward+backward {ratio:.2f}x  straggler events {len(run.events)}",
                flush=True,
            )
    if args.save_timings is not None:  # for studying rules offline
        saved = {"healthy": [asdict(r) for r in healthy], "slow": [asdict(r) for r in slow]}
        args.save_timings.write_text(json.dumps(saved))
    return healthy, slow


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    healthy, slow = sweep(args)
    slowdowns = sorted({r.slowdown for r in slow})
    configured = load_config([TINY], []).monitor
    result = {
        "runs": len(healthy),
        "judged_timing_steps": sum(len(r.timings) for r in healthy),
        "median_forward_backward_ms": round(
            1e3 * statistics.median(median_forward_backward(r) for r in healthy), 1
        ),
        "straggler_events_healthy": sum(len(r.events) for r in healthy),
        "straggler_events_slow": {
            f"x{s:g}": sum(len(r.events) for r in slow if r.slowdown == s) for s in slowdowns
        },
        "realised_ratio": {
            f"x{s:g}": [round(realised_ratio(r), 2) for r in slow if r.slowdown == s]
            for s in slowdowns
        },
        "rules": {name: score(healthy, slow, rule) for name, rule in rules(configured).items()},
        "seconds": round(time.perf_counter() - started, 1),
    }
    print(
        f"{'rule':<44} {'false/1k':>8} {'runs':>5} "
        + " ".join(f"{'det x' + format(s, 'g'):>9}" for s in slowdowns)
    )
    for name, r in result["rules"].items():
        print(
            f"{name:<44} {r['false_alarms_per_1k']:8.2f} {r['healthy_runs_with_alarm']:5d} "
            + " ".join(f"{r[f'detected_x{s:g}']:9.3f}" for s in slowdowns)
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
