"""Every transformers family bigtrain trains by its declared plans, under every layout: a table of
family x layout, each cell `equal` (per-step losses within 1e-5 of one process, FP32), the
largest difference when it is not, or `not supported` with the reason bigtrain gives.

Each family is its tiny config (tests/hf_families.py: vocabulary 384, d_model 64, 2 layers, MoE
families 4 experts), built here from transformers' own config class (no download), trained for
`--steps` steps on the test corpus (two plays, a 384-token BPE vocabulary) with a global batch
of 8 sequences of 32 tokens: once on one process, then on 2 gloo ranks in each layout:

- `fsdp2`: FSDP2 over 2 ranks (each half the batch);
- `tp2`: tensor parallelism 2 by the family's declared tp plan (no parallel.tp_plan);
- `pp2`: two pipeline stages cut by the family's declared pp plan (gpipe, 4 micro-batches);
- `ep2`: expert parallelism 2 (MoE families);
- `round trip`: the family's tiny model saved by transformers (`save_pretrained`: a Hub
  directory, MoE experts one tensor per expert) is `model.init_from` of a 2-rank run (ep2 for
  MoE families, fsdp2 for dense ones) that loads the weights transformers loads (fingerprint),
  trains and checkpoints; `bigtrain export --hf --check` passes on the checkpoint, the export
  has the Hub directory's tensor names, and `bigtrain generate`'s greedy ids (8 tokens) equal
  transformers' own `generate` on the export: `ok`, or what failed.

    python bench/families.py [--families llama qwen3 ...] [--layouts fsdp2 tp2 pp2 ep2]
        [--no-round-trip] [--steps N]
    python bench/families.py --healthy 300 [--ranks 2] [--router-drill STEP] [--families ...]

`--healthy STEPS` measures instead the router rules on healthy runs of the MoE families (their
routers watched by bigtrain/model/hf_routers.py): each family trains STEPS steps (default
settings: the rules on, BF16, FSDP2 over `--ranks` ranks with 4 micro-batches each, or one
process), and a line per family gives the anomalies, rollbacks and replays it had and the
worst ratio of the router z-loss and of the router spread to their 50-step running median
(the `router_logits` rule fires at 4x, `router_spread` at 8x). `--router-drill STEP` (with 2
ranks) also runs each family with the router-bias drill on rank 1 at STEP (expert 0's logit +10
in every MoE layer, `drill.router_bias`; the run goes on with `monitor.on_spike=skip`) and
gives the anomalies it raised: caught at STEP, or not.

The last line is JSON: {"families": {family: {layout: cell}}, "steps": N}; the table before it
is Markdown (docs/models.md holds the one of the last run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.conftest import micro_overrides, write_corpus  # noqa: E402
from tests.distributed import run_distributed, train_run  # noqa: E402
from tests.hf_families import (  # noqa: E402
    FAMILIES,
    MOE,
    hf_config_override,
    hub_fingerprint,
    round_trip,
    save_hub_dir,
)

LAYOUTS = {
    "fsdp2": ["parallel.backend=fsdp"],
    "tp2": ["parallel.backend=fsdp", "parallel.tensor_parallel=2"],
    "pp2": [
        "parallel.backend=fsdp",
        "parallel.pipeline_parallel=2",
        "parallel.pp_schedule=gpipe",
        "parallel.pp_microbatches=4",
    ],
    "ep2": ["parallel.backend=fsdp", "parallel.expert_parallel=2"],
}
TOLERANCE = 1e-5


def losses_or_error(args: list[str]) -> dict:
    """A run in a rank: its per-step losses, or the error that stopped it (its last line)."""
    from bigtrain.config import load_config
    from bigtrain.errors import ConfigError
    from bigtrain.parallel.env import read_env
    from bigtrain.runner import run
    from bigtrain.store.rundir import read_jsonl

    try:
        cfg = load_config([], args)
        run(cfg, read_env())
    except (ConfigError, NotImplementedError, ValueError, RuntimeError) as e:
        return {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[-1]}"}
    metrics = read_jsonl(Path(cfg.train.out_dir) / "metrics.jsonl")
    return {"losses": {m["step"]: m["loss"] for m in metrics if "loss" in m}}


def cell(reference: dict, result: dict) -> str:
    if "error" in result:
        return f"not supported: {result['error']}"
    ref, got = reference["losses"], result["losses"]
    if sorted(ref) != sorted(got):
        return f"steps differ: {sorted(got)} vs {sorted(ref)}"
    worst = max(abs(got[s] - ref[s]) / abs(ref[s]) for s in ref)
    return "equal" if worst <= TOLERANCE else f"differs: {worst:.1e}"


def trip(family: str, tmp: Path, args) -> str:
    """The round trip's cell (module docstring)."""
    hub = save_hub_dir(family, tmp / "hub")
    layout = "ep2" if family in MOE else "fsdp2"
    run_args = [
        a for a in args(family, "trip", *LAYOUTS[layout]) if not a.startswith("model.hf_config")
    ]
    run_args += [f"model.init_from={hub}", "checkpoint.every=2", "train.max_steps=2"]
    result = run_distributed(train_run, 2, run_args)[0]
    init = next(e for e in result["events"] if e["kind"] == "init_from")
    if init["fingerprint"] != hub_fingerprint(hub):
        return f"{layout}: the weights loaded differ from transformers' load"
    checkpoint = tmp / "trip" / "checkpoints" / "step_00000002"
    r = round_trip(checkpoint, hub, tmp / "out")
    failed = [
        what
        for what, ok in (
            ("export", r["export"] == 0),
            (f"check {r['check'].get('max_rel_diff')}", r["check"].get("ok")),
            ("tensor names", r["same_names"]),
            (f"generate {r['ours']} vs {r['theirs']}", r["ours"] == r["theirs"] and r["ours"]),
        )
        if not ok
    ]
    return f"ok ({layout})" if not failed else "failed: " + ", ".join(failed)


def healthy(family: str, tmp: Path, files, cache, steps: int, ranks: int, drill: int = 0) -> dict:
    """One healthy run of an MoE family for `--healthy`, or with the router-bias drill at step
    `drill` (module docstring)."""
    name = f"{family}-drill" if drill else family
    drilled = [
        "drill.router_bias=0",
        "drill.rank=1",
        f"drill.router_bias_step=[{drill}]",
        f"train.stop_at_step={drill + 3}",
        "monitor.on_spike=skip",
    ]
    args = micro_overrides(tmp / name, files, cache) + [
        "model.kind=hf",
        hf_config_override(family),
        f"train.max_steps={max(steps, drill + 3)}",
        "train.log_every=1",
        "train.eval_every=0",
        "checkpoint.every=0",
        "train.micro_batch_size=2",
        f"train.global_batch_size={8 * ranks}",
        *(["parallel.backend=fsdp"] if ranks > 1 else []),
        *(drilled if drill else []),
    ]
    result = run_distributed(train_run, ranks, args)[0]
    if drill:
        anomalies = [e for e in result["events"] if e["kind"] == "anomaly"]
        return {
            "family": family,
            "drill_step": drill,
            "anomalies": [(e.get("step"), e.get("metric")) for e in anomalies],
            "caught": any(e.get("step") == drill for e in anomalies),
        }
    flagged = ("anomaly", "rollback", "suspicion", "replay")
    events = [e for e in result["events"] if e["kind"] in flagged]
    metrics = result["metrics"]

    def worst_ratio(key: str) -> float:
        values = [m[key] for m in metrics if key in m]
        ratios = [
            v / statistics.median(values[max(0, i - 50) : i])
            for i, v in enumerate(values)
            if i and statistics.median(values[max(0, i - 50) : i]) > 0
        ]
        return round(max(ratios, default=0.0), 2)

    losses = [m["loss"] for m in metrics if "loss" in m]
    return {
        "family": family,
        "ranks": ranks,
        "steps": len(losses),
        "loss": [round(losses[0], 3), round(losses[-1], 3)],
        "flagged": [(e["kind"], e.get("step")) for e in events],
        "z_loss_ratio": worst_ratio("moe_z_loss_max"),
        "spread_ratio": worst_ratio("moe_router_spread"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES))
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS))
    parser.add_argument("--no-round-trip", action="store_true")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--healthy", type=int, default=0, metavar="STEPS")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--router-drill", type=int, default=0, metavar="STEP")
    a = parser.parse_args()
    if a.healthy:
        with tempfile.TemporaryDirectory() as tmp_dir:
            tmp = Path(tmp_dir)
            files = write_corpus(tmp)
            for family in [f for f in a.families if f in MOE]:
                line = healthy(family, tmp, files, tmp / "cache", a.healthy, a.ranks)
                print(json.dumps({"bench": "families-healthy", **line}), flush=True)
                if a.router_drill:
                    cfg = (family, tmp, files, tmp / "cache", a.healthy, 2, a.router_drill)
                    line = healthy(*cfg)
                    print(json.dumps({"bench": "families-router-drill", **line}), flush=True)
        return
    table: dict[str, dict[str, str]] = {}
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        files, cache = write_corpus(tmp), tmp / "cache"

        def args(family: str, name: str, *extra: str) -> list[str]:
            return micro_overrides(tmp / family / name, files, cache) + [
                "model.kind=hf",
                hf_config_override(family),
                f"train.max_steps={a.steps}",
                "train.log_every=1",
                "train.eval_every=0",
                "checkpoint.every=0",
                "precision.compute_dtype=fp32",
                "train.global_batch_size=8",
                "train.micro_batch_size=4",
                *extra,
            ]

        for family in a.families:
            reference = run_distributed(losses_or_error, 1, args(family, "one"))[0]
            assert "losses" in reference, (family, reference)
            row = table[family] = {}
            for layout in a.layouts:
                if layout == "ep2" and family not in MOE:
                    row[layout] = "dense family"
                    continue
                results = run_distributed(
                    losses_or_error, 2, args(family, layout, *LAYOUTS[layout])
                )
                row[layout] = cell(reference, results[0])
                print(f"{family:12} {layout:6} {row[layout]}", file=sys.stderr, flush=True)
            if not a.no_round_trip:
                row["round trip"] = trip(family, tmp / family, args)
                print(f"{family:12} round trip {row['round trip']}", file=sys.stderr, flush=True)
    columns = [*a.layouts, *([] if a.no_round_trip else ["round trip"])]
    print("| family | " + " | ".join(columns) + " |")
    print("| --- |" + " --- |" * len(columns))
    for family, row in table.items():
        print(f"| {family} | " + " | ".join(row[c] for c in columns) + " |")
    print(json.dumps({"bench": "families", "steps": a.steps, "families": table}))


if __name__ == "__main__":
    main()
