"""FP8 linears against BF16 on the same models, data and seeds, side by side (CPU or GPU).

    python bench/fp8.py [--steps 300] [--seeds 0 1 2] [--models tiny wide] [--jobs 2]
                        [--wide-seeds 0] [--drills-on tiny]
    python bench/fp8.py --check-cost 40     # only the error check's cost per checked step

For each model (configs/tiny.yaml in the Llama style, and a wider one) and seed:
  - healthy runs in BF16, tensorwise FP8 and rowwise FP8: the validation loss after `--steps`
    steps, and which layers fell back to BF16 (a fallback in a healthy run is a false alarm);
  - drill runs of each FP8 recipe: `drill.fp8_outlier_from` (an activation outlier that FP8
    flushes the other inputs under) and `drill.fp8_amax_step` (a broken amax): caught when the
    drilled layer fell back, for the drill's reason, before the run ended.
Each run is a child process with one thread (`--jobs` of them at once). On a CPU, FP8 trains
about 2.5x slower than BF16 (emulated casts): `--wide-seeds` and `--drills-on` keep the wide
model to fewer seeds and no drills there.

The last line is JSON: `val_loss_rel_diff` ({recipe: mean over models and seeds of
(fp8 - bf16) / bf16}), `val_loss_rel_diff_by_model`, `fallback_layers_healthy`,
`fallback_drill_caught` (fraction of drill runs caught) and the settings.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLAMA = [
    "model.position=rope",
    "model.norm=rmsnorm",
    "model.mlp=swiglu",
    "model.bias=false",
]
MODELS = {
    "tiny": LLAMA,  # d_model 128, 4 layers, 4 heads
    "wide": [*LLAMA, "model.d_model=256", "model.n_heads=8"],
}
VARIANTS = {
    "bf16": ["precision.fp8.enabled=false"],
    "tensorwise": ["precision.fp8.enabled=true", "precision.fp8.recipe=tensorwise"],
    "rowwise": ["precision.fp8.enabled=true", "precision.fp8.recipe=rowwise"],
}
DRILL_LAYER = "blocks.1.mlp.down"


def drills(steps: int) -> dict[str, tuple[list[str], str]]:
    """Drill name -> (overrides, the fallback reason that catches it)."""
    start = steps // 3
    return {
        "outlier": ([f"drill.fp8_outlier_from={start}"], "error"),
        "amax": ([f"drill.fp8_amax_step=[{start}]"], "nonfinite"),
    }


def common(steps: int, out: str, seed: int, check_every: int) -> list[str]:
    return [
        "precision.compute_dtype=bf16",
        "wandb.mode=disabled",
        "train.progress=false",
        f"train.max_steps={steps}",
        f"train.eval_every={steps}",
        "train.eval_batches=8",
        f"train.log_every={max(1, steps // 10)}",
        f"train.seed={seed}",
        "checkpoint.every=-1",
        f"precision.fp8.check_every={check_every}",
        f"train.out_dir={out}",
    ]


def train(overrides: list[str]) -> dict:
    """One run in a child process with one thread: its validation loss and FP8 events."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}
    code = (
        "import sys, json, torch; torch.set_num_threads(1)\n"
        "from pathlib import Path\n"
        "from bigtrain.config import load_config\n"
        "from bigtrain.parallel.env import DistEnv\n"
        "from bigtrain.runner import run\n"
        "from bigtrain.store.rundir import read_jsonl\n"
        "cfg = load_config([sys.argv[1]], sys.argv[2:])\n"
        "final = run(cfg, DistEnv())\n"
        "out = Path(cfg.train.out_dir)\n"
        "metrics = read_jsonl(out / 'metrics.jsonl')\n"
        "events = read_jsonl(out / 'events.jsonl')\n"
        "print(json.dumps({'val_loss': [m['val_loss'] for m in metrics if 'val_loss' in m][-1],\n"
        "  'loss': final['loss'], 'rollbacks': final['rollbacks'],\n"
        "  'median_step_s': final['costs']['median_step_s'],\n"
        "  'fallback': [{k: e[k] for k in ('step', 'layer', 'reason')} for e in events\n"
        "               if e['kind'] == 'fp8_fallback']}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(ROOT / "configs" / "tiny.yaml"), *overrides],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        check=False,
    )
    if done.returncode != 0:
        sys.exit(f"bench/fp8.py: a run failed ({overrides}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def check_cost(steps: int) -> None:
    """The FP8 error check's cost, side by side: configs/tiny.yaml (Llama style, tensorwise) for
    `steps` steps with a check on every step and with none, alternated three times (one thread
    each, one at a time); the median of the runs' median step times of each. A checked step runs
    each FP8 layer's BF16 matmul once more on the step's first micro-batch."""
    out = tempfile.mkdtemp(prefix="bigtrain-fp8-cost-")
    times: dict[int, list[float]] = {0: [], 1: []}
    for trial in range(3):
        for every in (0, 1):
            overrides = common(steps, f"{out}/every{every}-{trial}", 0, every)
            overrides += [*LLAMA, *VARIANTS["tensorwise"]]
            times[every].append(train(overrides)["median_step_s"])
    plain, checked = (sorted(times[e])[1] for e in (0, 1))
    extra = checked / plain - 1
    print(f"median step: {plain:.4f} s unchecked, {checked:.4f} s checked: +{extra:.1%} a check")
    for every in (25, 50):
        print(f"  at check_every={every}: +{extra / every:.2%} of the run's time")
    print(
        json.dumps(
            {
                "check_cost": extra,
                "step_s": {"unchecked": plain, "checked": checked},
                "runs_s": {str(k): v for k, v in times.items()},
                "steps": steps,
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--wide-seeds", type=int, nargs="+", default=None)
    parser.add_argument("--drills-on", nargs="+", default=None, choices=list(MODELS))
    parser.add_argument("--check-every", type=int, default=25)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument(
        "--check-cost",
        type=int,
        default=0,
        metavar="STEPS",
        help="only measure the error check's cost: tiny FP8 runs of STEPS steps, checked every "
        "step and never, alternated 3 times",
    )
    args = parser.parse_args()
    if args.check_cost:
        check_cost(args.check_cost)
        return
    out = tempfile.mkdtemp(prefix="bigtrain-fp8-")
    jobs: dict[tuple, list[str]] = {}
    seeds = {m: args.seeds for m in args.models}
    if args.wide_seeds is not None and "wide" in seeds:
        seeds["wide"] = args.wide_seeds
    drilled = args.models if args.drills_on is None else args.drills_on
    for model in args.models:
        for seed in seeds[model]:
            base = [*MODELS[model]]
            for variant, extra in VARIANTS.items():
                key = ("healthy", model, variant, seed)
                run_dir = f"{out}/{model}-{variant}-{seed}"
                jobs[key] = common(args.steps, run_dir, seed, args.check_every) + base + extra
            for recipe in ("tensorwise", "rowwise") if model in drilled else ():
                for drill, (extra, _) in drills(args.steps).items():
                    key = ("drill", model, recipe, seed, drill)
                    run_dir = f"{out}/{model}-{recipe}-{seed}-{drill}"
                    jobs[key] = (
                        common(args.steps, run_dir, seed, args.check_every)
                        + base
                        + VARIANTS[recipe]
                        + extra
                        + [f"drill.fp8_layer={DRILL_LAYER}"]
                    )
    with ThreadPoolExecutor(args.jobs) as pool:
        results = dict(zip(jobs, pool.map(train, jobs.values()), strict=True))

    print(f"{'model':<6} {'seed':>4} {'bf16 val':>9} {'tensorwise':>11} {'rowwise':>9}  fell back")
    rel: dict[str, dict[str, list[float]]] = {}
    false_alarms = []
    for model in args.models:
        for seed in seeds[model]:
            row = {v: results[("healthy", model, v, seed)] for v in VARIANTS}
            base = row["bf16"]["val_loss"]
            fell = [f"{v}:{f['layer']}" for v in VARIANTS for f in row[v]["fallback"]]
            false_alarms += fell
            for recipe in ("tensorwise", "rowwise"):
                diff = (row[recipe]["val_loss"] - base) / base
                rel.setdefault(recipe, {}).setdefault(model, []).append(diff)
            print(
                f"{model:<6} {seed:>4} {base:>9.4f} {row['tensorwise']['val_loss']:>11.4f} "
                f"{row['rowwise']['val_loss']:>9.4f}  {', '.join(fell) or '-'}"
            )
    caught, drill_rows = 0, []
    for key, result in results.items():
        if key[0] != "drill":
            continue
        _, model, recipe, seed, drill = key
        reason = drills(args.steps)[drill][1]
        hit = [f for f in result["fallback"] if f["layer"] == DRILL_LAYER and f["reason"] == reason]
        caught += bool(hit)
        drill_rows.append((model, recipe, seed, drill, hit[0]["step"] if hit else None, result))
    print(f"\n{'model':<6} {'recipe':<10} {'seed':>4} {'drill':<8} caught at step  (rollbacks)")
    for model, recipe, seed, drill, step, result in drill_rows:
        print(
            f"{model:<6} {recipe:<10} {seed:>4} {drill:<8} {step if step else 'missed':>14}  "
            f"({result['rollbacks']})"
        )
    mean = {
        r: sum(sum(v) for v in m.values()) / sum(len(v) for v in m.values()) for r, m in rel.items()
    }
    by_model = {r: {m: sum(v) / len(v) for m, v in ms.items()} for r, ms in rel.items()}
    print(
        "\nval loss (fp8 - bf16) / bf16, mean over models and seeds: "
        + ", ".join(f"{r} {v:+.4f}" for r, v in mean.items())
    )
    print(
        json.dumps(
            {
                "val_loss_rel_diff": mean,
                "val_loss_rel_diff_by_model": by_model,
                "fallback_layers_healthy": len(false_alarms),
                "fallback_healthy_layers": false_alarms,
                "fallback_drill_caught": caught / max(1, len(drill_rows)),
                "drill_runs": len(drill_rows),
                "steps": args.steps,
                "seeds": seeds,
                "drills_on": drilled,
                "models": args.models,
                "check_every": args.check_every,
            }
        )
    )


if __name__ == "__main__":
    main()
