"""INT8 forward against BF16 on the same model and data, side by side.

    python bench/int8.py [CONFIG ...] [key=value ...] [--steps N] [--batch B]

Measured in one run:
  - saved for backward: bytes autograd keeps from one forward of a micro-batch (unique storages),
    all of them and those of the linear layers' inputs, in this process;
  - peak memory: CUDA max_memory_allocated of a training run, or on CPU the process's peak RSS
    (each variant trains in a child process of its own, so the peaks do not mix);
  - tokens/s of training (mean over the logged intervals after the first), and the INT8
    matmul alone against the BF16 one at the model's largest linear shape;
  - final training and validation loss after the same steps.
The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bigtrain.config import load_config  # noqa: E402
from bigtrain.model import build_model  # noqa: E402
from bigtrain.precision.int8 import Int8Linear, convert_to_int8, int_mm_available  # noqa: E402

VARIANTS = {"bf16": [], "int8": ["precision.int8.enabled=true"]}
COMMON = ["precision.compute_dtype=bf16", "wandb.mode=disabled", "train.progress=false"]


def saved_bytes(cfg, int8: bool, batch: int, device: torch.device) -> dict[str, int]:
    """Bytes autograd saves for backward in one forward (each storage once)."""
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.model.vocab_size or cfg.data.vocab_size).to(device)
    if int8:
        convert_to_int8(model, cfg.precision.int8)
    inside: list[bool] = [False]  # whether a linear layer's forward is running
    for m in model.modules():
        if isinstance(m, nn.Linear | Int8Linear):
            m.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
            m.register_forward_hook(lambda *_: inside.__setitem__(0, False))
    seen: dict[int, tuple[int, bool]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, nn.Parameter):  # the master weights are held anyway
            storage = t.untyped_storage()
            seen.setdefault(storage.data_ptr(), (storage.nbytes(), inside[0]))
        return t

    ids = torch.randint(0, 256, (batch, cfg.model.seq_len), device=device)
    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        torch.autocast(device.type, dtype=torch.bfloat16),
    ):
        logits = model(ids)
    del logits
    return {
        "all": sum(n for n, _ in seen.values()),
        "linear_layers": sum(n for n, linear in seen.values() if linear),
    }


def matmul_speed(m: int, k: int, n: int, device: torch.device) -> dict[str, float]:
    """Seconds per call of the INT8 matmul (with its quantization) and of the BF16 one."""
    from bigtrain.precision.int8 import Int8LinearFunction

    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    w16 = w.to(torch.bfloat16)
    qx = torch.randint(-127, 127, (m, k), dtype=torch.int8, device=device)
    qw = torch.randint(-127, 127, (n, k), dtype=torch.int8, device=device)
    calls = {
        "bf16_matmul": lambda: x @ w16.t(),
        "int8_matmul": lambda: torch._int_mm(qx, qw.t()),
        "int8_linear_with_quantization": lambda: Int8LinearFunction.apply(
            x, w, None, None, True, False
        ),
    }
    out = {}
    for name, call in calls.items():
        for _ in range(3):
            call()
        sync()
        started, reps = time.perf_counter(), 10
        for _ in range(reps):
            call()
        sync()
        out[name] = (time.perf_counter() - started) / reps
    return out


def child(files: list[str], overrides: list[str]) -> None:
    """Train one variant; print its numbers as JSON (runs in its own process)."""
    from bigtrain.parallel.env import DistEnv
    from bigtrain.runner import run
    from bigtrain.store.rundir import read_jsonl

    cfg = load_config(files, overrides)
    final = run(cfg, DistEnv())
    metrics = read_jsonl(Path(cfg.train.out_dir) / "metrics.jsonl")
    speeds = [m["tokens_per_s"] for m in metrics if "tokens_per_s" in m][1:]
    if torch.cuda.is_available():
        peak = torch.cuda.max_memory_allocated()
        kind = "cuda max_memory_allocated"
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        kind = "peak RSS"
    print(
        json.dumps(
            {
                "tokens_per_s": sum(speeds) / max(1, len(speeds)),
                "train_loss": final["loss"],
                "val_loss": [m["val_loss"] for m in metrics if "val_loss" in m][-1],
                "peak_bytes": peak,
                "peak_kind": kind,
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("items", nargs="*", default=[])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=16, help="micro-batch size")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    files = [i for i in args.items if "=" not in i] or [str(ROOT / "configs" / "tiny.yaml")]
    user = [i for i in args.items if "=" in i]
    if args.child:
        child(files, user)
        return
    out = tempfile.mkdtemp(prefix="bigtrain-int8-")
    cfg = load_config(files, COMMON + user)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows: dict[str, dict] = {}
    for name, extra in VARIANTS.items():
        overrides = [
            *COMMON,
            f"train.max_steps={args.steps}",
            f"train.eval_every={args.steps}",
            f"train.log_every={max(1, args.steps // 5)}",
            f"train.micro_batch_size={args.batch}",
            "checkpoint.every=-1",
            f"train.out_dir={out}/{name}",
            *extra,
            *user,
        ]
        done = subprocess.run(
            [sys.executable, __file__, "--child", *files, *overrides],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            sys.exit(f"bench/int8.py: the {name} run failed:\n{done.stderr[-3000:]}")
        rows[name] = json.loads(done.stdout.strip().splitlines()[-1])
        rows[name]["saved"] = saved_bytes(cfg, bool(extra), args.batch, device)
    d = cfg.model.d_model
    shape = (args.batch * cfg.model.seq_len, d, 4 * d)
    speed = matmul_speed(*shape, device) if int_mm_available(device) else {}

    print(
        f"{'variant':<8} {'tokens/s':>9} {'saved MB':>9} {'in linears MB':>13} "
        f"{'peak MB':>9} {'train':>7} {'val':>7}"
    )
    for name, r in rows.items():
        s = r["saved"]
        linear = s["linear_layers"]
        print(
            f"{name:<8} {r['tokens_per_s']:>9.0f} {s['all'] / 2**20:>9.2f} {linear / 2**20:>13.2f} "
            f"{r['peak_bytes'] / 2**20:>9.0f} {r['train_loss']:>7.3f} {r['val_loss']:>7.3f}"
        )
    b, i = rows["bf16"], rows["int8"]
    ratios = {
        "saved_for_backward": i["saved"]["all"] / b["saved"]["all"],
        "saved_in_linear_layers": i["saved"]["linear_layers"] / b["saved"]["linear_layers"],
        "peak_memory": i["peak_bytes"] / b["peak_bytes"],
        "tokens_per_s": i["tokens_per_s"] / b["tokens_per_s"],
        "val_loss": i["val_loss"] / b["val_loss"],
    }
    print("int8 / bf16: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
    print(f"(peak memory: {b['peak_kind']}; saved MB: one forward of {args.batch} sequences)")
    if speed:
        print(
            f"matmul {shape[0]}x{shape[1]}x{shape[2]}: bf16 {speed['bf16_matmul'] * 1e3:.3f} ms, "
            f"int8 {speed['int8_matmul'] * 1e3:.3f} ms, int8 with quantization "
            f"{speed['int8_linear_with_quantization'] * 1e3:.3f} ms"
        )
    print(
        json.dumps(
            {
                "bench": "int8",
                "steps": args.steps,
                "micro_batch_size": args.batch,
                "variants": rows,
                "ratios": ratios,
                "matmul_s": speed,
                "matmul_shape": shape,
                "device": str(device),
                "machine": f"{platform.machine()}, torch {torch.__version__}",
            }
        )
    )


if __name__ == "__main__":
    main()
