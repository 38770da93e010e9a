"""How long a checkpoint stops the training loop: synchronous against asynchronous, side by side.

    python bench/checkpoint.py [CONFIG ...] [key=value ...] [--backends local,zero] [--rounds R]
                               [--modes sync,async,snapshot]

For each backend (one process; ZeRO on a one-rank gloo group) a model whose checkpoint holds at
least 400 MB (by default configs/tiny.yaml widened to ~40M parameters: FP32 weights + two FP32
moments) trains two steps, then the same state is saved, in alternating rounds:
  - sync: CheckpointManager.save with async_ok=False (copy, write, fsync, hash, commit): the loop
    waits for all of it;
  - async: the loop's stall is the time save() takes to return (the host copy and the hand-over
    to the writer thread); the background write, fsync and hash are timed apart, to the commit;
  - async from a snapshot: the same, handed the host copy a rollback snapshot of this step took
    (the default config snapshots at every checkpoint step), so only the hand-over remains.
Then the newest is loaded back into the trainer's backend, as a resume does (`load_s`, its
files' verification apart). Goal: async stall <= 0.1 of the synchronous save (on a GPU also <= 2 s for the 1B recipe, see
bench/gpu.sh). The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bigtrain.build import build_trainer  # noqa: E402
from bigtrain.checkpoint.manager import CheckpointManager  # noqa: E402
from bigtrain.config import load_config  # noqa: E402
from bigtrain.parallel.env import free_port, read_env, shutdown  # noqa: E402

WIDE = ["model.n_layers=8", "model.d_model=640", "model.n_heads=8", "train.micro_batch_size=2"]


def timed_saves(
    trainer, manager: CheckpointManager, rounds: int, modes: list[str]
) -> dict[str, float]:
    t: dict[str, list[float]] = {"sync_s": [], "async_stall_s": [], "async_write_s": []}
    t["async_from_snapshot_stall_s"] = []
    setup = trainer.setup
    args = (trainer.backend, trainer.run.state_dict(), setup.identity, setup.config_yaml)
    step = trainer.step
    for _ in range(rounds):
        for mode in modes:
            step += 1  # a new directory each time (the state is the same)
            host = trainer.backend.local_state() if mode == "snapshot" else None
            start = time.perf_counter()
            manager.save(step, *args, async_ok=mode != "sync", host_state=host)
            stall = time.perf_counter() - start
            if mode == "sync":
                t["sync_s"].append(stall)
                continue
            manager.finish_pending()
            done = time.perf_counter() - start
            key = "async_stall_s" if mode == "async" else "async_from_snapshot_stall_s"
            t[key].append(stall)
            if mode == "async":
                t["async_write_s"].append(done - stall)
    return {k: statistics.median(v) for k, v in t.items() if v}


def bench_backend(backend: str, config: list[str], rounds: int, modes: list[str]) -> dict:
    files = [c for c in config if "=" not in c] or [str(ROOT / "configs/tiny.yaml")]
    overrides = [c for c in config if "=" in c] or WIDE
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(
            files,
            [
                *overrides,
                f"train.out_dir={out}",
                f"parallel.backend={backend}",
                "train.max_steps=1000",
                "checkpoint.every=0",
                "checkpoint.keep=2",
                "train.eval_every=0",
                "train.progress=false",
                "wandb.mode=disabled",
            ],
        )
        trainer = build_trainer(cfg, read_env())
        for _ in range(2):
            trainer.train_step()
        manager = CheckpointManager(Path(out) / "bench-checkpoints", keep=2)
        result = timed_saves(trainer, manager, rounds, modes)
        newest = manager.committed()[-1]
        loads = []
        for _ in range(rounds):  # the load a resume does (its files verified apart)
            start = time.perf_counter()
            manager.load(newest, trainer.backend)
            loads.append(time.perf_counter() - start)
        result["load_s"] = statistics.median(loads)
        result["bytes"] = sum(p.stat().st_size for p in newest.rglob("*") if p.is_file())
        if "async_stall_s" in result:
            result["ratio"] = result["async_stall_s"] / result["sync_s"]
        if "async_from_snapshot_stall_s" in result:
            snapshot = result["async_from_snapshot_stall_s"]
            result["ratio_from_snapshot"] = snapshot / result["sync_s"]
        trainer.callbacks.close()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("config", nargs="*", help="config files and key=value overrides")
    ap.add_argument("--backends", default="local,zero")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default="sync,async,snapshot")
    args = ap.parse_args()
    modes = args.modes.split(",")
    if "sync" not in modes or not set(modes) <= {"sync", "async", "snapshot"}:
        ap.error("--modes: sync plus any of async, snapshot")
    # One process: ZeRO still needs a process group (of one rank).
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    results = {
        b: bench_backend(b, args.config, args.rounds, modes) for b in args.backends.split(",")
    }
    for name, r in results.items():
        line = f"{name:6s} {r['bytes'] / 1e6:7.0f} MB: load {r['load_s']:.3f} s, sync {r['sync_s']:.3f} s"
        if "ratio" in r:
            line += (
                f", async stall {r['async_stall_s']:.3f} s ({r['ratio']:.3f} of sync; "
                f"background write {r['async_write_s']:.3f} s)"
            )
        if "ratio_from_snapshot" in r:
            line += (
                f", from a snapshot {r['async_from_snapshot_stall_s']:.4f} s "
                f"({r['ratio_from_snapshot']:.4f})"
            )
        print(line)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(
        json.dumps(
            {
                "bench": "checkpoint",
                "device": device,
                "bytes": max(r["bytes"] for r in results.values()),
                "backends": results,
            }
        )
    )
    shutdown(clean=True)


if __name__ == "__main__":
    main()
