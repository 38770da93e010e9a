"""A mixture-of-experts model against the dense model with the same active parameters, and the
all-to-all's share of an expert-parallel step.

1. One process: configs/moe-tiny.yaml (8 experts of 192 SwiGLU units, 2 per token, in blocks
   1-3) against the same model with dense MLPs of 384 units (what one token multiplies in both):
   tokens/s of whole training steps (monitor, clipping, optimizer included) after a warm-up,
   and the parameters each holds.
2. Two spawned ranks (gloo on CPU, one thread each), FSDP2: the MoE model with its experts on
   every rank (expert_parallel 1) and split over both (expert_parallel 2): tokens/s, and under
   ep 2 the seconds spent in the token all-to-alls (dispatch and combine, forward and backward;
   the per-layer exchange of counts is not timed) over the step's.

    python bench/moe.py [--steps N] [key=value ...]

The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.scaling import BASE, WARMUP, timed  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402

CONFIG = str(ROOT / "configs" / "moe-tiny.yaml")
DENSE = ["model.moe.experts=0", "model.d_ff=384"]  # 2 experts x 192 units = one MLP of 384

SPENT = [0.0]  # seconds in the token all-to-alls of this process


class TimedAllToAll(torch.autograd.Function):
    """funcol.all_to_all_single_autograd, with its forward and backward timed into SPENT."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):  # type: ignore[override]
        import torch.distributed._functional_collectives as funcol

        ctx.meta = (out_splits, in_splits, group)
        start = time.perf_counter()
        y = funcol.wait_tensor(
            funcol.all_to_all_single(x.contiguous(), out_splits, in_splits, group)
        )
        SPENT[0] += time.perf_counter() - start
        return y

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        import torch.distributed._functional_collectives as funcol

        out_splits, in_splits, group = ctx.meta
        start = time.perf_counter()
        g = funcol.all_to_all_single(grad.contiguous(), in_splits, out_splits, group)
        g = funcol.wait_tensor(g)
        SPENT[0] += time.perf_counter() - start
        return g, None, None, None


def timed_all_to_all(files: list[str], overrides: list[str], steps: int) -> dict:
    """`timed` with the MoE layers' token all-to-alls timed (after the warm-up steps)."""
    import bigtrain.model.moe as moe
    from bigtrain.build import build_trainer
    from bigtrain.config import load_config
    from bigtrain.parallel.env import read_env, shutdown

    moe.funcol.all_to_all_single_autograd = TimedAllToAll.apply  # type: ignore[assignment]
    trainer = build_trainer(load_config(files, overrides), read_env())
    try:
        for _ in range(WARMUP):
            trainer.train_step()
        SPENT[0] = 0.0
        start = time.perf_counter()
        for _ in range(steps):
            float(trainer.train_step().loss)
        seconds = time.perf_counter() - start
        return {
            "tokens_per_s": steps * trainer.tokens_per_step / seconds,
            "all_to_all_share": SPENT[0] / seconds,
        }
    finally:
        trainer.callbacks.close()
        shutdown(clean=True)


def params(files: list[str], overrides: list[str]) -> tuple[int, int]:
    """(total, active per token) parameters of the config's model."""
    from bigtrain.config import load_config
    from bigtrain.model import num_params
    from bigtrain.plan.shapes import meta_model

    cfg = load_config(files, overrides)
    model = meta_model(cfg.model, cfg.data)
    return num_params(model), num_params(model, active=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("items", nargs="*", default=[])
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    out = tempfile.mkdtemp(prefix="bigtrain-moe-")
    base = [*BASE, "eval.sample_every=0", "train.micro_batch_size=8", *args.items]
    files = [CONFIG]

    def run(name: str, world: int, extra: list[str], fn=timed) -> dict:
        overrides = [*base, f"train.out_dir={out}/{name}", *extra]
        return run_distributed(fn, world, files, overrides, args.steps)[0]

    dense, moe = run("dense", 1, DENSE), run("moe", 1, [])
    fsdp = ["parallel.backend=fsdp", "precision.compute_dtype=fp32"]
    ep1 = run("ep1", 2, [*fsdp, "parallel.expert_parallel=1"])
    ep2 = run("ep2", 2, [*fsdp, "parallel.expert_parallel=2"], timed_all_to_all)
    (dense_total, dense_active), (moe_total, moe_active) = params(files, DENSE), params(files, [])
    summary = {
        "bench": "moe",
        "steps": args.steps,
        "machine": f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}",
        "dense_params": dense_total,
        "moe_params": moe_total,
        "moe_active_params": moe_active,
        "dense_tokens_per_s": round(dense["tokens_per_s"], 1),
        "moe_tokens_per_s": round(moe["tokens_per_s"], 1),
        "moe_vs_dense": round(moe["tokens_per_s"] / dense["tokens_per_s"], 3),
        "ep1_tokens_per_s": round(ep1["tokens_per_s"], 1),
        "ep2_tokens_per_s": round(ep2["tokens_per_s"], 1),
        "ep2_vs_ep1": round(ep2["tokens_per_s"] / ep1["tokens_per_s"], 3),
        "ep2_all_to_all_share": round(ep2["all_to_all_share"], 4),
    }
    assert dense_active == dense_total and abs(moe_active - dense_active) <= 0.02 * dense_active
    print(f"dense {dense_total / 1e6:.2f}M params: {dense['tokens_per_s']:.0f} tokens/s")
    print(
        f"moe   {moe_total / 1e6:.2f}M params ({moe_active / 1e6:.2f}M active): "
        f"{moe['tokens_per_s']:.0f} tokens/s ({summary['moe_vs_dense']:.2f}x dense)"
    )
    print(
        f"2 ranks FSDP2: ep 1 {ep1['tokens_per_s']:.0f}, ep 2 {ep2['tokens_per_s']:.0f} tokens/s; "
        f"all-to-all {summary['ep2_all_to_all_share']:.1%} of the ep 2 step"
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
