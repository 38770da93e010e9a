"""Refactors must not change the numbers: 20 steps of a micro model on local (1 process), fsdp and
zero-2 (2 ranks each, torchrun on gloo), every step's loss and the final weight fingerprint.

    python bench/loss_compare.py --save ref.json [--repo DIR]    # before a change
    python bench/loss_compare.py --check ref.json                # after it: exit 1 on any change
    python bench/loss_compare.py --tiny 60 --save ref.json       # configs/tiny.yaml as shipped

`--tiny N`: configs/tiny.yaml with its own model, precision and batch (not the micro model), for
N steps, every step's loss logged (the architecture refactors' check).

`--repo` runs another checkout's code (its `python -m bigtrain`), so a reference can be taken from
the commit before the change. Results are bit-exact only on the same machine and library versions.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MICRO = [
    "model.n_layers=2",
    "model.n_heads=2",
    "model.d_model=64",
    "model.seq_len=32",
    "data.vocab_size=384",
    "train.micro_batch_size=8",
    "train.max_steps=20",
    "train.log_every=1",
    "train.eval_every=0",
    "train.progress=false",
    "optim.lr=3e-3",
    "optim.warmup_steps=5",
    "checkpoint.every=-1",
    "wandb.mode=disabled",
    "precision.preset=fp32",
]
BACKENDS = {
    "local": ["parallel.backend=local"],
    "fsdp": ["parallel.backend=fsdp"],
    "zero-2": ["parallel.backend=zero", "parallel.zero_stage=2"],
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny(steps: int) -> list[str]:
    """configs/tiny.yaml as shipped, for `steps` steps, every loss logged, no checkpoints."""
    return [
        f"train.max_steps={steps}",
        "train.log_every=1",
        "train.progress=false",
        "checkpoint.every=-1",
        "wandb.mode=disabled",
    ]


def one_run(repo: Path, backend: str, out: Path, cache: Path, steps: int | None = None) -> dict:
    overrides = MICRO if steps is None else tiny(steps)
    args = ["train", "configs/tiny.yaml", *overrides, *BACKENDS[backend]]
    args += [f"train.out_dir={out}", f"data.cache_dir={cache}"]
    if backend == "local":
        command = [sys.executable, "-m", "bigtrain", *args]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
        command += ["--master-port", str(free_port()), "-m", "bigtrain", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    result = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{backend} failed:\n{result.stderr[-3000:]}")
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    final = json.loads((out / "final.json").read_text())
    return {
        "losses": [m["loss"] for m in metrics if "loss" in m],
        "fingerprint": final["fingerprint"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--save", type=Path)
    parser.add_argument("--check", type=Path)
    parser.add_argument("--repo", type=Path, default=ROOT)
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS))
    parser.add_argument("--tiny", type=int, metavar="STEPS", help="configs/tiny.yaml as shipped")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        got = {
            b: one_run(args.repo, b, Path(tmp) / b, Path(tmp) / "cache", args.tiny)
            for b in args.backends
        }
    for backend, result in got.items():
        losses = result["losses"]
        print(f"{backend:7s} loss@{len(losses)} {losses[-1]:.6f} {result['fingerprint']}")
    if args.save:
        args.save.write_text(json.dumps(got, indent=1) + "\n")
    if args.check:
        reference = json.loads(args.check.read_text())
        changed = [b for b in got if got[b] != reference.get(b)]
        print("identical to the reference" if not changed else f"CHANGED: {changed}")
        sys.exit(1 if changed else 0)


if __name__ == "__main__":
    main()
