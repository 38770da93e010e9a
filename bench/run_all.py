"""Run every benchmark on this machine and print one table.

    python bench/run_all.py [--only NAME ...] [--full]

Each script runs in its own process with sizes chosen to finish in about 10 minutes on 2 CPU
cores (`--full`: the scripts' own defaults). Its last line (JSON) is appended, with the machine's
description, to bench/results/<machine>.jsonl; the table shows the headline number of each. A
script that fails is shown as failed (with its last lines) and the others still run; the exit code
is then 1.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

# name -> (script, reduced-size arguments)
BENCHES: dict[str, tuple[str, list[str]]] = {
    "overhead": ("overhead.py", ["--rounds", "5"]),
    "scaling": ("scaling.py", ["--steps", "12"]),
    "pipeline": ("pipeline.py", ["--steps", "8"]),
    "monitor": ("monitor.py", ["--reps", "3", "--steps", "20"]),
    "recovery": ("recovery.py", ["--steps", "150", "--every", "75"]),
    "precision": ("precision.py", ["--steps", "30"]),
    "int8": ("int8.py", ["--steps", "100"]),
    "speed": ("speed.py", ["--steps", "24"]),
    "prepare": ("prepare.py", ["--copies", "2", "--rounds", "2"]),
    "detection": ("detection.py", ["--quick"]),
    "generate": ("generate.py", ["--new-tokens", "128", "--reps", "2"]),
    "profile_off": ("profile_off.py", ["--rounds", "6"]),
    "sinks": ("sinks.py", ["--rounds", "6"]),
}


def machine() -> dict[str, str | int]:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    out: dict[str, str | int] = {
        "cpu": cpu,
        "cores": os.cpu_count() or 0,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "host": platform.node(),
    }
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name()
        out["gpus"] = torch.cuda.device_count()
    return out


def headline(name: str, r: dict) -> str:
    """The one-line result of each benchmark, from its JSON."""
    if name == "overhead":
        return f"bigtrain / raw loop tokens/s: {r['ratio']:.3f} (goal >= 0.95)"
    if name == "scaling":
        parts = [f"{k[:-6]}: {v:.2f}x" for k, v in r.items() if k.endswith("_ratio")]
        return "vs 1 process: " + ", ".join(parts)
    if name == "pipeline":
        return ", ".join(
            f"pp2 {k} {r[f'pp2_{k}_vs_fsdp2']:.2f}x fsdp x2 (bubble {r[f'pp2_{k}_bubble_measured']:.0%}"
            f" measured, {r[f'pp2_{k}_bubble_theory']:.0%} theory)"
            for k in ("1f1b", "gpipe")
        )
    if name == "monitor":
        stats = ", ".join(
            f"{s['num_tensors']} tensors {s['speedup_vs_naive_same_stats']:.1f}x"
            for s in r["stats"]
        )
        share = ", ".join(f"every={s['monitor_every']} {s['share_of_step']:.1%}" for s in r["step"])
        return f"vs same-stats loop: {stats}; share of step: {share}"
    if name == "recovery":
        mem, disk = r["recovery"]
        return (
            f"rollback {mem['restore_s'] * 1e3:.0f} ms (memory) / {disk['restore_s'] * 1e3:.0f} ms "
            f"(disk); faults {r['wall']['ratio']:.3f}x wall; async ckpt stall "
            f"{r['checkpoint']['ratio']:.2f} of sync"
        )
    if name == "precision":
        return ", ".join(
            f"{k} {v['tokens_per_s']:.0f} tok/s val {v['val_loss']:.3f}"
            for k, v in r["variants"].items()
        )
    if name == "int8":
        q = r["ratios"]
        return (
            f"int8/bf16: saved activations {q['saved_for_backward']:.2f}x, tokens/s "
            f"{q['tokens_per_s']:.2f}x, val loss {q['val_loss']:.3f}x"
        )
    if name == "speed":
        return ", ".join(
            f"{k} {v['vs_plain']:.2f}x (MFU {v['mfu']:.1%})" for k, v in r["variants"].items()
        )
    if name == "prepare":
        rss = r["peak_rss_mb"]
        return (
            f"{r['mb_per_s']:.2f} MB/s = {r['ratio']:.2f}x a bare encode loop (goal >= 0.8); peak RSS "
            f"{rss['1x']:.0f} MB at 1x, {rss['4x']:.0f} MB at 4x (goal <= 1.3x)"
        )
    if name == "detection":
        rates = r["detection_rate"]
        kinds = ("nan_grad", "inf_grad", "nan_loss", "spike_x50", "spike_x10")
        return (
            f"{r['false_alarms_per_1000']:.2f} false alarms / 1000 healthy steps "
            f"({r['healthy_runs']} runs); caught: "
            + ", ".join(f"{k} {rates[k]:.0%}" for k in kinds)
            + f"; validated {r['validated'][0]}/{r['validated'][1]}"
        )
    if name == "generate":
        rate = r["tokens_per_s"]
        return (
            f"KV cache {rate['kv_cache']:.0f} tok/s vs recompute {rate['recompute']:.0f} tok/s: "
            f"{r['ratio']:.2f}x ({r['new_tokens']} tokens after {r['prompt_tokens']})"
        )
    if name == "profile_off":
        return (
            f"profiling off / no range marks: {r['ratio_off_before']:.3f}; the marks alone "
            f"{r['marks_ns_per_step']:.0f} ns/step ({r['marks_share_of_step']:.1e} of a step)"
        )
    if name == "sinks":
        return (
            f"wandb+TensorBoard+MLflow / wandb alone: {r['ratio_all_wandb']:.3f} "
            f"(log_every={r['log_every']})"
        )
    return json.dumps(r)[:120]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=None, choices=sorted(BENCHES))
    parser.add_argument("--full", action="store_true", help="the scripts' default sizes")
    args = parser.parse_args()
    about = machine()
    label = re.sub(r"[^A-Za-z0-9]+", "-", str(about.get("gpu", about["cpu"]))).strip("-")
    results_file = ROOT / "bench" / "results" / f"{label.lower()}.jsonl"
    results_file.parent.mkdir(exist_ok=True)
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": str(ROOT)}
    rows, failed = [], False
    for name, (script, reduced) in BENCHES.items():
        if args.only and name not in args.only:
            continue
        started = time.time()
        cmd = [sys.executable, str(ROOT / "bench" / script), *([] if args.full else reduced)]
        print(f"running {' '.join(cmd[1:])}", flush=True)
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        seconds = time.time() - started
        lines = done.stdout.strip().splitlines()
        try:
            result = json.loads(lines[-1]) if done.returncode == 0 else None
        except (IndexError, json.JSONDecodeError):
            result = None
        if result is None:
            failed = True
            tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
            rows.append((name, seconds, "FAILED: " + " | ".join(tail)))
            continue
        record = {
            "bench": name,
            "time": time.time(),
            "seconds": seconds,
            "machine": about,
            "args": cmd[2:],
            "result": result,
        }
        with results_file.open("a") as f:
            f.write(json.dumps(record) + "\n")
        rows.append((name, seconds, headline(name, result)))
    print(
        f"\nbigtrain benchmarks on {about.get('gpu', about['cpu'])} ({about['cores']} cores, "
        f"torch {about['torch']}); JSON lines in {results_file.relative_to(ROOT)}"
    )
    print(f"{'bench':<10} {'time':>6}  result")
    for name, seconds, text in rows:
        print(f"{name:<10} {seconds:>5.0f}s  {text}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
