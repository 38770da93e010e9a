"""The goodput table of docs/goodput.md: the Llama-style 7B and 70B recipes at 512 to 16,384 GPUs,
with bigtrain's healing and with plain checkpoint/restart, then what the 70B at 16,384 GPUs needs
to keep 95%.

    python bench/goodput.py [--trials N] [--seed S] [--from RUN_DIR]

Every input is plan --goodput's default (Llama 3's failure rates; costs from public figures; the
recipe's checkpoint size, step time and cadence), or measured in RUN_DIR with --from. Prints
markdown tables; the last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bigtrain.config import load_config  # noqa: E402
from bigtrain.plan.goodput import plan_goodput  # noqa: E402

GPUS = (512, 2048, 8192, 16384)
RESTARTS = (600, 300, 180, 60)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--from", dest="from_dir", type=Path, default=None)
    args = ap.parse_args()
    rows, out = [], {}
    print(
        "| recipe | GPUs | goodput, healing (band) | plain C/R | best interval: steps (s) "
        "| goodput at best, healing / plain | cut first |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for recipe in ("llama-7b", "llama-70b"):
        cfg = load_config([f"configs/{recipe}.yaml"], [])
        for gpus in GPUS:
            plan = plan_goodput(cfg, gpus, args.from_dir, trials=args.trials, seed=args.seed)
            h, p = plan.healing, plan.plain
            step = plan.src.values["step_s"]
            cut = plan.cuts[0][0] if plan.cuts[0][1] > 0 else "-"
            print(
                f"| {recipe} (every {cfg.checkpoint.every}) | {gpus:,} | {h.goodput:.1%} "
                f"({h.band[0]:.1%}-{h.band[1]:.1%}) | {p.goodput:.1%} | "
                f"{h.best_interval_s / step:.0f} ({h.best_interval_s:.0f}) | "
                f"{h.goodput_at_best:.1%} / {p.goodput_at_best:.1%} | {cut} |"
            )
            out[f"{recipe}@{gpus}"] = plan.to_json()
            rows.append((recipe, gpus, h.goodput_at_best))
    cfg = load_config(["configs/llama-70b.yaml"], [])
    print("\n| llama-70b at 16,384 GPUs: restart_s | goodput at best, healing | best steps |")
    print("| ---: | ---: | ---: |")
    for restart in RESTARTS:
        sets = [f"restart_s={restart}"]
        plan = plan_goodput(cfg, 16384, args.from_dir, sets, args.trials, args.seed)
        step = plan.src.values["step_s"]
        h = plan.healing
        print(f"| {restart} | {h.goodput_at_best:.1%} | {h.best_interval_s / step:.0f} |")
        out[f"llama-70b@16384 restart_s={restart}"] = plan.to_json()
    print(
        json.dumps(
            {
                k: {
                    "goodput": v["goodput"],
                    "best_interval_s": v["best_interval_s"],
                    "goodput_at_best": v["goodput_at_best"],
                }
                for k, v in out.items()
            }
        )
    )


if __name__ == "__main__":
    main()
