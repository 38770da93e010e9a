"""Detection quality, measured: false alarms on healthy runs, faults caught, steps to detection.

    python bench/detection.py [--quick] [--seeds 1,2] [--runs N] [--steps 300] [--validate K]
                              [--short-runs N] [--short-steps 100]
                              [--no-candidates] [--save-fixtures DIR] [--threads T]
                              [--moe] [--router-drills N] [--fp8]
                              [--save-traces FILE] [--load-traces FILE ...]

1. Healthy sweep: real runs in this process, detection on as configured (monitor.*): seeds x
   FP32/BF16 x GPT-2/Llama style x two corpora (the embedded Shakespeare and the Python standard
   library's own top-level modules, prepared with `bigtrain prepare`) x LR 1x/2x of tiny's 3e-3,
   300 steps each. Full: configs/tiny.yaml, seeds 1,2: 32 runs. --quick: a micro model (2 layers,
   2 heads, width 64, 64 tokens, vocabulary 512), seed 1: 16 runs. Every `anomaly` event of these
   runs is a false alarm. Each run records what the monitor saw per step and per emulated rank
   (detection_runs.py: 2 micro-batches = 2 ranks, row halves = FSDP2's shards).
   Short sweep: the first --short-runs runs of the same matrix on configs/tiny.yaml (the model
   a new user trains; tiny MoE with --moe) for --short-steps steps each, warm-up and the whole
   schedule included (16 x 100 by default, 0: none): a run's whole life, where the suspicion
   tier's healthy replays were most frequent.
2. Fault sweep, simulated exactly on those traces with bigtrain's own Detector
   (detection_sim.py): NaN/Inf gradient, NaN loss, spikes of x10 and x50 of loss and gradients
   (a bad batch), of the reported loss only and of one gradient tensor (first execution only:
   silent data corruption), bit flips of one gradient value, on either rank, at every step of
   [2, 300], warm-up included: the detection rate per kind at the faulty step. A first-execution
   fault counts as caught by an anomaly, by a suspicion (bigtrain/resilience/suspicion.py) or by
   a gradient checksum mismatch (bigtrain/monitor/checksums.py, on the steps they check: the
   runs record each tensor's and row half's healthy residual, and the faulty one follows from it,
   detection_sim.scaled_check), whose replay comes out clean; `suspicions_per_1k` is the healthy steps the suspicion tier replays
   over every step of every run, both sweeps (simulated on the 2 emulated ranks; the runs' own,
   one process each, beside it, and their transient verdicts, each of which would be false);
   the one-tensor faults are also simulated on one process (`one_process`: the tensor's whole
   gradient x F). `sweeps` holds each sweep's numbers, and the steps of their healthy replays.
3. Validation: K real FSDP2 runs on 2 gloo ranks (full 12, --quick 4) with one injected fault
   each (kind, run, step and rank drawn with a fixed seed); their anomaly steps against the
   simulated verdicts, and their steps from fault to detection.
4. Candidates (default on; cheap): other rules' false alarms and detection rates on the same
   traces, against bigtrain's configured monitor.rules.

--save-traces keeps the healthy runs' traces; --load-traces judges saved ones again with this
checkout's rules instead of training (the simulated numbers only: the runs' own were the
recording's): how a rule is compared with another on the same runs.

--fp8: the BF16 runs of the matrix train with FP8 linears (precision.fp8, tensorwise, an error
check every 25 steps); every `fp8_fallback` of a healthy run is a false alarm of the FP8 rule
(`fp8_fallbacks_healthy` in the JSON).

--moe: the same matrix with every block a mixture of 4 experts (top 2): false alarms of every
rule (the router rules included), the fault sweep on the MoE traces, and `--router-drills` real
2-rank runs (quick 4, full 8) whose rank favours expert 0 in every router at a drawn step
(drill.router_bias), caught at that step or not.

Measured on 2 CPU cores shared with other jobs: --quick took 35 minutes (the 16 micro runs
22-67 s each, the 16 short tiny runs 23-83 s each, the fault sweep about 7 minutes, validation
52 s); --load-traces of the same runs 5-7 minutes. The micro model shows the healthy dynamics the rules were chosen from
on tiny. Largest value over the median of the last 50 (a tensor's norm: of its last 20) in the 16
micro runs: loss 1.073x, global gradient norm 74x (warm-up step 22 of GPT-2 style, stdlib, LR 2x),
one tensor 125,000x (blocks.1.attn.q.bias, the same step); in the 6 tiny runs of
tests/resilience/traces: 1.072x, 53x, 22,757x. No false alarm in either.

The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import pickle
import random
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from detection_runs import (  # noqa: E402
    ROUTER_KEYS,
    TINY,
    Trace,
    Trial,
    checksum_margin,
    healthy_run,
    matrix,
    validate,
)
from detection_sim import (  # noqa: E402
    CANDIDATES,
    FIRST_STEP,
    KINDS,
    SPIKES,
    judge,
    one_process,
    simulate,
)

from bigtrain.config import load_config  # noqa: E402
from bigtrain.resilience.detect import ROUTER_VALUES  # noqa: E402

ISSUE_KINDS = ("nan_grad", "inf_grad", "nan_loss", "spike_x50", "spike_x10")
ROUTER_RULES = tuple(ROUTER_VALUES)  # the rules reading ROUTER_KEYS, in the same order
ROUTER_DRILL = "router_bias"  # real runs only: a biased router changes the routing itself
VALIDATED = tuple(k for k in KINDS if not k.startswith(("grad_spike_x", "bitflip")))  # one tensor
FIXTURES = 6  # the matrix's first 6 runs cover both levels of every factor
ONE_TENSOR = ("grad_spike_x10", "grad_spike_x50")  # also simulated on one process
TIER_KINDS = ("grad_spike_x10", "grad_spike_x50", "grad_spike_first_x10", "grad_spike_first_x50")
TIER_KINDS += ("bitflip",)  # the kinds the suspicion tier is for (each sweep's rates)
PHASES = ((1, 20), (21, 50), (51, 100), (101, 300))  # steps: warm-up, early, the rest


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="micro model, one seed, 4 validations")
    ap.add_argument("--seeds", default=None, help="comma-separated (default 1,2; --quick: 1)")
    ap.add_argument("--runs", type=int, default=None, help="only the matrix's first N runs")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--validate", type=int, default=None, help="real 2-rank runs (12; quick 4)")
    ap.add_argument(
        "--short-runs", type=int, default=16, help="tiny runs of --short-steps (0: none)"
    )
    ap.add_argument("--short-steps", type=int, default=100)
    ap.add_argument("--no-candidates", action="store_true")
    ap.add_argument("--save-fixtures", type=Path, default=None, metavar="DIR")
    ap.add_argument("--save-traces", type=Path, default=None, metavar="FILE", help="pickle")
    ap.add_argument(
        "--load-traces",
        type=Path,
        nargs="+",
        default=None,
        metavar="FILE",
        help="judge saved traces with this checkout's rules instead of training (no real runs)",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the healthy runs")
    ap.add_argument("--moe", action="store_true", help="MoE models (4 experts, top 2) + drills")
    ap.add_argument(
        "--fp8", action="store_true", help="the BF16 runs with FP8 linears (precision.fp8)"
    )
    ap.add_argument("--router-drills", type=int, default=None, help="real router-bias runs")
    args = ap.parse_args()
    args.seeds = [int(s) for s in (args.seeds or ("1" if args.quick else "1,2")).split(",")]
    if args.validate is None:
        args.validate = 4 if args.quick else 12
    if args.router_drills is None:
        args.router_drills = (4 if args.quick else 8) if args.moe else 0
    return args


def healthy_sweep(specs: list, out_root: str) -> list[Trace]:
    traces = []
    for i, spec in enumerate(specs):
        trace = healthy_run(spec, str(Path(out_root) / spec.name))
        jumps = {metric: d["ratio"] for metric, d in dynamics(trace).items()}
        print(
            f"  {i + 1:2d}/{len(specs)} {spec.name:<42} {trace.seconds:5.1f} s  "
            f"false alarms {len(trace.anomalies)}  suspicions {len(trace.suspicions)}  "
            + (f"fp8 fallbacks {len(trace.fp8_fallbacks)}  " if trace.spec.fp8 else "")
            + f"loss <= {jumps['loss']:.3f}x  "
            f"grad norm <= {jumps['grad_norm']:.1f}x  one tensor <= {jumps['tensor']:.0f}x"
            + "".join(f"  {m} <= {jumps[m]:.2f}x" for m in ROUTER_RULES if m in jumps),
            flush=True,
        )
        traces.append(trace)
    return traces


def sweep_specs(args: argparse.Namespace) -> tuple[list, list]:
    """The long sweep (--quick: micro, else tiny; --steps each) and the short one (tiny,
    --short-steps each, the matrix's first --short-runs)."""
    long = matrix(args.seeds, args.quick, args.steps, args.moe, args.fp8)[: args.runs]
    short = matrix(args.seeds, False, args.short_steps, args.moe, args.fp8)[: args.short_runs]
    return long, short


def over_median(values: np.ndarray, window: int) -> np.ndarray:
    """Each value (or row) from the second on over the median of the `window` before it."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.stack(
            [
                values[i] / np.median(values[max(0, i - window) : i], axis=0)
                for i in range(1, len(values))
            ]
        )


def dynamics(trace: Trace) -> dict[str, dict]:
    """The largest jumps of a healthy run, with where they happened: loss and gradient norm over
    the median of their last 50 values, one tensor's norm over the median of its last 20."""
    tensors = np.sqrt(np.stack(trace.halves).sum(axis=2))  # [step, tensor]
    ratios = {
        "loss": over_median(np.asarray(trace.loss), 50),
        "grad_norm": over_median(np.asarray(trace.grad_norm), 50),
        "tensor": over_median(tensors, 20),
    }
    for rule, key in zip(ROUTER_RULES, ROUTER_KEYS, strict=True):  # an MoE run's router series
        if trace.routers and key in trace.routers[0]:
            ratios[rule] = over_median(np.asarray([r[key] for r in trace.routers]), 50)
    out = {}
    for metric, ratio in ratios.items():
        ratio = np.where(np.isfinite(ratio), ratio, np.nan)  # a tensor with no gradient yet
        index = np.unravel_index(np.nanargmax(ratio), ratio.shape)
        out[metric] = {
            "ratio": round(float(ratio[index]), 4),
            "run": trace.name,
            "step": int(index[0]) + 2,
        }
        if metric == "tensor":
            out[metric]["tensor"] = trace.names[index[1]]
    return out


def rates(caught: list[dict[str, np.ndarray]], kinds: tuple[str, ...]) -> dict[str, float]:
    """Per kind, the share of faults caught at their step (over runs, steps, ranks, tensors)."""
    out = {}
    for kind in kinds:
        values = np.concatenate([c[kind].ravel() for c in caught])
        out[kind] = round(float(np.nanmean(values)), 4)
    return out


def steps_to_detect(caught: list[dict[str, np.ndarray]]) -> dict[str, dict[str, int]]:
    """Per kind: faults caught at their own step ("0") and missed there (the simulation sees no
    later step)."""
    out = {}
    for kind in KINDS:
        values = np.concatenate([c[kind].ravel() for c in caught])
        values = values[~np.isnan(values)]
        out[kind] = {"0": int(values.sum()), "missed": int(len(values) - values.sum())}
    return out


def draw_trials(traces: list[Trace], count: int, steps: int, drills: int = 0) -> list[Trial]:
    """`count` faults of the simulated kinds and `drills` router-bias drills (MoE), each on a
    drawn run, step and rank."""
    rng = random.Random(0)
    kinds = [rng.choice(VALIDATED) for _ in range(count)] + [ROUTER_DRILL] * drills
    return [
        Trial(rng.choice(traces).spec, kind, rng.randint(FIRST_STEP, steps), rng.randrange(2))
        for kind in kinds
    ]


def validation(traces, sims, count: int, steps: int, out_root: str, drills: int = 0) -> dict:
    """Real 2-rank runs of drawn faults against the simulated verdicts of the same faults; the
    router drills (no simulated verdict) are counted by their own real detection."""
    trials = draw_trials(traces, count, steps, drills)
    found = validate(trials, out_root) if trials else []
    index = {t.name: i for i, t in enumerate(traces)}
    records, agree = [], 0
    for trial, anomalies in zip(trials, found, strict=True):
        simulated = None
        if trial.kind != ROUTER_DRILL:
            caught = sims[index[trial.spec.name]].caught[trial.kind]
            simulated = bool(caught[trial.step - FIRST_STEP, trial.rank])
        after = [a - trial.step for a in anomalies if a >= trial.step]
        real = min(after) if after else None
        agree += simulated == (real == 0) if simulated is not None else 0
        records.append(
            {
                "run": trial.spec.name,
                "kind": trial.kind,
                "step": trial.step,
                "rank": trial.rank,
                "steps_to_detect": real,  # None: nothing by step + 3
                "simulated_caught": simulated,
                "anomalies_before": [a for a in anomalies if a < trial.step],
            }
        )
    simulated = sum(r["simulated_caught"] is not None for r in records)
    return {"validated": [agree, simulated], "trials": records}


def candidates(traces: list[Trace], healthy_steps: int) -> dict[str, dict]:
    out = {}
    for candidate in CANDIDATES:
        judged = [judge(candidate, t) for t in traces]
        alarms = sum(len(j.false_alarms) for j in judged)
        out[candidate.name] = {
            "false_alarms": alarms,
            "false_alarms_per_1000": round(1000 * alarms / healthy_steps, 3),
            "detection_rate": rates([j.caught for j in judged], SPIKES),
        }
    return out


def save_fixtures(traces: list[Trace], directory: Path) -> list[Path]:
    """The first FIXTURES healthy traces (both levels of every factor), per step loss and
    gradient norm to 6 significant digits: the data of tests/resilience/test_rules.py."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for trace in traces[:FIXTURES]:
        spec = trace.spec
        data = {
            "name": spec.name,
            "config": "configs/tiny.yaml" if not spec.micro else "configs/tiny.yaml + micro model",
            "run": {k: v for k, v in asdict(spec).items() if k != "micro"},
            "loss": [float(f"{v:.6g}") for v in trace.loss],
            "grad_norm": [float(f"{v:.6g}") for v in trace.grad_norm],
        }
        path = directory / f"{spec.name}.json"
        path.write_text(json.dumps(data, separators=(",", ":")) + "\n")
        written.append(path)
    return written


def num(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def print_table(result: dict, seconds: dict[str, float]) -> None:
    runs, steps = result["healthy_runs"], result["healthy_steps"]
    model, took = result["model"], seconds["healthy"]
    print(
        f"\nhealthy sweeps: {runs} runs, {steps} steps ({model} model, short: tiny), {took:.0f} s"
    )
    print(
        f"  false alarms: {result['false_alarms']} ({num(result['false_alarms_per_1000'])} per "
        f"1000 steps); the simulation's replay of the same steps: "
        f"{result['false_alarms_simulated']}"
    )
    for alarm in result["false_alarm_events"]:
        print(f"    {alarm}")
    print(
        f"  suspicions (a replay each) per 1000 healthy steps, whole runs: "
        f"{result['suspicions_per_1k']:.2f} on 2 emulated ranks (simulated), "
        f"{result['suspicions_one_process_per_1k']:.2f} on one process (simulated), "
        f"{num(result['suspicions_real_per_1k'])} in the runs (one process); transient verdicts: "
        f"{result['transient_verdicts']}"
    )
    c = result["checksums"]
    print(
        f"  gradient checksums: {c['checked_steps']} healthy steps checked (until step "
        f"{c['until_step']}), largest residual {c['largest_healthy_residual']:.2g} "
        f"(tolerance {c['tolerance']}; {c['where']})"
    )
    for name, s in result["sweeps"].items():
        r, solo = s["detection_rate"], s["detection_rate_one_process"]
        print(
            f"    {name}: {s['runs']} {s['model']} runs x {s['steps'] // max(s['runs'], 1)} steps: "
            f"{s['suspicions_per_1k']:.2f} / {s['suspicions_one_process_per_1k']:.2f} / "
            f"{num(s['suspicions_real_per_1k'])} (by steps, 2 ranks {s['suspicions_by_phase']}, "
            f"real {s['suspicions_real_by_phase']}); one tensor x50 / x10 "
            f"{r['grad_spike_x50']:.1%} / {r['grad_spike_x10']:.1%} on 2 ranks, "
            f"{solo['grad_spike_x50']:.1%} / {solo['grad_spike_x10']:.1%} on one process"
        )
    d = result["healthy_dynamics"]
    shown_metrics = [("loss", "loss"), ("grad_norm", "grad norm"), ("tensor", "one tensor")]
    shown_metrics += [(m, m.replace("_", " ")) for m in ROUTER_RULES if m in d]
    for metric, what in shown_metrics:
        window = 20 if metric == "tensor" else 50
        where = f"{d[metric]['run']} step {d[metric]['step']}"
        where += f" {d[metric]['tensor']}" if metric == "tensor" else ""
        ratio = d[metric]["ratio"]
        shown = f"{ratio:.3f}" if ratio < 10 else f"{ratio:.0f}"
        print(f"  largest healthy {what}: {shown}x its median of the last {window} ({where})")
    rules, took = result["rules"]["rules"], seconds["simulate"]
    print(
        f"\nfault sweep (simulated at every step from {FIRST_STEP} of every run on both ranks; "
        f"monitor.rules={rules}), {took:.0f} s"
    )
    print(f"  {'kind':<22} {'caught':>8} {'at step':>8} {'missed':>8}")
    for kind, rate in result["detection_rate"].items():
        s = result["steps_to_detect"][kind]
        print(f"  {kind:<22} {rate:>8.1%} {s['0']:>8} {s['missed']:>8}")
    v = result["validated"]
    took = seconds["validate"]
    print(f"\nvalidation (real 2-rank FSDP2 runs): {v[0]} of {v[1]} agree, {took:.0f} s")
    for t in result["validation_trials"]:
        real = (
            "missed by step+3"
            if t["steps_to_detect"] is None
            else f"caught after {t['steps_to_detect']} steps"
        )
        sim = {None: "not simulated", True: "caught", False: "missed"}[t["simulated_caught"]]
        fault = f"{t['kind']:<20} step {t['step']:3d} rank {t['rank']}"
        print(f"  {t['run']:<42} {fault}: real {real}; simulated {sim}")
    if result["moe"]:
        r = result["router_bias"]
        print(
            f"  router-bias drills (MoE): {r['caught_at_step']} of {r['trials']} caught at their step"
        )
    if result["candidates"]:
        print_candidates(result)


def print_candidates(result: dict) -> None:
    short = [
        k.replace("grad_spike_first", "grad1")
        .replace("loss_spike", "loss")
        .replace("grad_spike", "grad")
        for k in SPIKES
    ]
    print(
        "\ncandidates on the same traces (false alarms per 1000 healthy steps; caught at the step):"
    )
    print(f"  {'rule':<58} {'FA/1000':>7} " + " ".join(f"{k:>9}" for k in short))
    rows = {
        "bigtrain monitor.rules (configured)": {
            "false_alarms_per_1000": result["false_alarms_per_1000"],
            "detection_rate": result["detection_rate"],
        }
    }
    for name, row in {**rows, **result["candidates"]}.items():  # long sweep only
        cells = " ".join(f"{row['detection_rate'][k]:>9.1%}" for k in SPIKES)
        print(f"  {name:<58} {num(row['false_alarms_per_1000']):>7} {cells}")


def real_steps_to_detect(trials: list[dict]) -> dict[str, dict[str, int]]:
    """Per kind, the real runs' steps from fault to anomaly ("missed": none by step + 3)."""
    out: dict[str, dict[str, int]] = {}
    for t in trials:
        key = "missed" if t["steps_to_detect"] is None else str(t["steps_to_detect"])
        counts = out.setdefault(t["kind"], {})
        counts[key] = counts.get(key, 0) + 1
    return out


def per_1k(count: int, steps: int) -> float:
    return round(1000 * count / steps, 3) if steps else 0.0


def by_phase(steps: list[int]) -> dict[str, int]:
    return {f"{a}-{b}": sum(a <= s <= b for s in steps) for a, b in PHASES}


def sweep_summary(traces: list[Trace], sims, solo) -> dict:
    """One sweep's healthy replays (simulated on 2 ranks and on one process, and the runs' own,
    one process) and its one-tensor catch rates, over whole runs."""
    steps = sum(len(t.loss) for t in traces)
    simulated = [s for sim in sims for s in sim.suspicions]
    real = [e["step"] for t in traces for e in t.suspicions]
    return {
        "runs": len(traces),
        "steps": steps,
        "model": traces[0].spec.name.split("-")[0] if traces else None,
        "suspicions_per_1k": per_1k(len(simulated), steps),
        "suspicions_real_per_1k": per_1k(len(real), steps),
        "suspicions_one_process_per_1k": per_1k(sum(len(s.suspicions) for s in solo), steps),
        "suspicions_by_phase": by_phase(simulated),
        "suspicions_real_by_phase": by_phase(real),
        "suspicion_steps": [
            [t.name, s] for t, sim in zip(traces, sims, strict=True) for s in sim.suspicions
        ],
        "suspicion_steps_real": [
            [t.name, e["step"], (e["tensors"] or e.get("checksums") or [[None]])[0][0]]
            for t in traces
            for e in t.suspicions
        ],
        "detection_rate": rates([s.caught for s in sims], TIER_KINDS) if sims else {},
        "detection_rate_one_process": rates([s.caught for s in solo], ONE_TENSOR) if solo else {},
    }


def summary(args, sweeps: dict, checked: dict, found: dict) -> dict:
    traces = [t for ts, _, _ in sweeps.values() for t in ts]
    sims = [s for _, ss, _ in sweeps.values() for s in ss]
    solo = [s for _, _, ss in sweeps.values() for s in ss]
    healthy_steps = sum(len(t.loss) for t in traces)
    alarms = [
        [t.name, a["step"], a.get("type"), a.get("metric"), a.get("value"), a.get("threshold")]
        for t in traces
        for a in t.anomalies
    ]
    caught = [s.caught for s in sims]
    order = ISSUE_KINDS + tuple(k for k in KINDS if k not in ISSUE_KINDS)
    monitor = traces[0].monitor
    jumps = [dynamics(t) for t in traces]
    drills = [t for t in checked["trials"] if t["kind"] == ROUTER_DRILL]
    return {
        "bench": "detection",
        "mode": "quick" if args.quick else "full",
        "moe": args.moe,
        "fp8": args.fp8,
        # FP8 layers moved to BF16 in healthy runs (docs/fp8.md): each one a false alarm
        "fp8_fallbacks_healthy": [
            [t.name, e["step"], e["layer"], e["reason"]]
            for t in traces
            for e in getattr(t, "fp8_fallbacks", [])
        ],
        "router_bias": {
            "trials": len(drills),
            "caught_at_step": sum(t["steps_to_detect"] == 0 for t in drills),
        },
        "model": "micro" if args.quick else "tiny",
        "healthy_runs": len(traces),
        "healthy_steps": healthy_steps,
        "steps": args.steps,
        "false_alarms": len(alarms),
        "false_alarms_per_1000": round(1000 * len(alarms) / healthy_steps, 3),
        "false_alarms_simulated": sum(len(s.false_alarms) for s in sims),
        "suspicions_per_1k": per_1k(sum(len(s.suspicions) for s in sims), healthy_steps),
        "suspicions_real_per_1k": per_1k(sum(len(t.suspicions) for t in traces), healthy_steps),
        "suspicions_one_process_per_1k": per_1k(
            sum(len(s.suspicions) for s in solo), healthy_steps
        ),
        "transient_verdicts": sum(  # on healthy runs: each would be a false one
            e["verdict"] == "transient" for t in traces for e in t.suspicions
        ),
        "false_alarm_events": alarms,
        "checksums": checksum_margin(traces, monitor),
        "detection_rate": rates(caught, order),
        "one_process": {"detection_rate": rates([s.caught for s in solo], ONE_TENSOR)},
        "sweeps": {name: sweep_summary(*parts) for name, parts in sweeps.items() if parts[0]},
        "steps_to_detect": steps_to_detect(caught),
        "steps_to_detect_real": real_steps_to_detect(checked["trials"]),
        "validated": checked["validated"],
        "validation_trials": checked["trials"],
        "candidates": found,
        "rules": {
            "rules": list(monitor.rules),
            **{m: asdict(getattr(monitor, m)) for m in ("loss", "grad_norm", *ROUTER_RULES)},
            "suspicion": asdict(monitor.suspicion),
        },
        "healthy_dynamics": {
            k: max((j[k] for j in jumps), key=lambda v: v["ratio"]) for k in jumps[0]
        },
    }


def loaded(args: argparse.Namespace, long_specs: list, short_specs: list) -> tuple[list, list]:
    """The saved traces of these sweeps' runs (--load-traces), judged by this checkout's
    settings: the simulation's numbers are this checkout's; the runs' own events (their
    suspicions and alarms) were the recording's, and are dropped."""
    saved = {t.name: t for path in args.load_traces for t in pickle.loads(path.read_bytes())}
    for trace in saved.values():  # recorded before the gradient checksums: none were checked
        trace.__dict__.setdefault("checks", [])
        trace.__dict__.setdefault("checks_whole", [])
    missing = [s.name for s in long_specs + short_specs if s.name not in saved]
    if missing:
        raise SystemExit(f"--load-traces: no trace of {', '.join(missing)}")
    sweeps = []
    for specs in (long_specs, short_specs):
        traces = [saved[s.name] for s in specs]
        for trace in traces:
            trace.monitor, trace.anomalies, trace.suspicions = load_config([TINY]).monitor, [], []
        sweeps.append(traces)
    return sweeps[0], sweeps[1]


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)  # one thread: no OpenMP spinning on a shared machine
    seconds, started = {}, time.perf_counter()
    long_specs, short_specs = sweep_specs(args)
    with tempfile.TemporaryDirectory() as out_root:
        if args.load_traces:
            traces, short = loaded(args, long_specs, short_specs)
        else:
            print("healthy runs:", flush=True)
            traces = healthy_sweep(long_specs, out_root)
            short = []
            if short_specs:
                print(f"short runs (whole lives of {args.short_steps} steps):", flush=True)
                short = healthy_sweep(short_specs, out_root)
        if args.save_traces is not None:  # for studying rules offline
            args.save_traces.write_bytes(pickle.dumps(traces + short))
        seconds["healthy"] = time.perf_counter() - started
        sims = [simulate(t, t.monitor) for t in traces]
        short_sims = [simulate(t, t.monitor) for t in short]
        solo = [simulate(one_process(t), t.monitor, ONE_TENSOR) for t in traces]
        short_solo = [simulate(one_process(t), t.monitor, ONE_TENSOR) for t in short]
        seconds["simulate"] = time.perf_counter() - started - seconds["healthy"]
        checked = validation(traces, sims, args.validate, args.steps, out_root, args.router_drills)
        seconds["validate"] = time.perf_counter() - started - sum(seconds.values())
    healthy_steps = sum(len(t.loss) for t in traces)
    found = {} if args.no_candidates or not traces else candidates(traces, healthy_steps)
    sweeps = {"long": (traces, sims, solo), "short": (short, short_sims, short_solo)}
    result = summary(args, sweeps, checked, found)
    if args.load_traces:  # the recording's own runs were judged by the rules it had
        result["runs_trained"] = False
        for d in (result, *result["sweeps"].values()):
            for key in (
                "suspicions_real_per_1k",
                "suspicions_real_by_phase",
                "suspicion_steps_real",
            ):
                d[key] = None
        for key in ("false_alarms", "false_alarms_per_1000", "transient_verdicts"):
            result[key] = None
    if args.save_fixtures is not None:
        for path in save_fixtures(traces, args.save_fixtures):
            print(f"fixture {path} ({path.stat().st_size} bytes)")
    result["seconds"] = round(time.perf_counter() - started, 1)
    print_table(result, seconds)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
