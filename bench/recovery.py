"""Recovery costs of the rollback machinery, measured side by side in one process.

    python bench/recovery.py [--steps N] [--every K]

1. Time from detection to the first resumed step, restoring from a host-memory snapshot and from
   the newest disk checkpoint (`resilience.snapshot_every=0`), on configs/tiny.yaml.
2. Total wall time of N steps with one injected NaN every K steps against a fault-free run of the
   same N steps (goal <= 1.10x). Settings: resilience.snapshot_every=5, confirm_steps=3, so a
   rollback redoes about 5-8 steps.
3. The training stall of a checkpoint: FSDP2 (one process), an asynchronous save (a host copy,
   then DCP writes from it in the background) against a synchronous save of the same state, on a larger model (goal: async <= 1/10 of sync).

The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bigtrain.build import build_trainer  # noqa: E402
from bigtrain.config import load_config  # noqa: E402
from bigtrain.parallel.env import DistEnv, shutdown  # noqa: E402

FAST = ["train.eval_every=0", "train.progress=false", "wandb.mode=disabled", "train.log_every=50"]


def trainer_for(out: str, *overrides: str):
    cfg = load_config(
        [str(ROOT / "configs/tiny.yaml")], [f"train.out_dir={out}", *FAST, *overrides]
    )
    return build_trainer(cfg, DistEnv())


def recovery_time(source: str) -> dict:
    """Seconds from the anomaly's detection to the end of the first step after the rollback."""
    snapshot_every = "5" if source == "memory" else "0"
    with tempfile.TemporaryDirectory() as out:
        trainer = trainer_for(
            out,
            "train.max_steps=40",
            "checkpoint.every=10",
            f"resilience.snapshot_every={snapshot_every}",
            "resilience.confirm_steps=3",
            "drill.nan_grad_step=23",
        )
        healer, timing = trainer.healer, {}
        original = healer._rollback

        def timed(result):
            timing["detected"] = time.perf_counter()
            original(result)
            timing["restored"] = time.perf_counter()
            timing["to_step"] = trainer.step

        healer._rollback = timed

        def step() -> None:
            result = trainer.train_step()
            healer.after_step(result)
            trainer.callbacks.on_step_end(trainer, result)
            healer.end_step()

        trainer.callbacks.on_start(trainer)
        healer.start(resumed=False)
        while "to_step" not in timing:
            step()
        step()
        resumed = time.perf_counter()
        trainer.callbacks.close()
    return {
        "source": source,
        "restored_to_step": timing["to_step"],
        "restore_s": timing["restored"] - timing["detected"],
        "to_first_resumed_step_s": resumed - timing["detected"],
    }


def wall_time(steps: int, fault_every: int) -> dict:
    """Fault-free and faulty runs of `steps` steps, alternating twice; best of each."""
    faults = ",".join(str(s) for s in range(fault_every, steps + 1, fault_every))
    runs: dict[str, list[float]] = {"clean": [], "faulty": []}
    for _ in range(2):
        for name, extra in (("clean", []), ("faulty", [f"drill.nan_grad_step=[{faults}]"])):
            with tempfile.TemporaryDirectory() as out:
                trainer = trainer_for(
                    out,
                    f"train.max_steps={steps}",
                    "checkpoint.every=-1",
                    "checkpoint.keep=1",
                    "resilience.snapshot_every=5",
                    "resilience.confirm_steps=3",
                    *extra,
                )
                start = time.perf_counter()
                trainer.fit()
                runs[name].append(time.perf_counter() - start)
                rollbacks = trainer.state.rollbacks
                trainer.callbacks.close()
            if name == "faulty":
                assert rollbacks == len(faults.split(",")), rollbacks
    clean, faulty = min(runs["clean"]), min(runs["faulty"])
    return {
        "steps": steps,
        "fault_every": fault_every,
        "clean_s": clean,
        "faulty_s": faulty,
        "ratio": faulty / clean,
    }


def checkpoint_stall() -> dict:
    """Seconds the training loop waits for a checkpoint: async vs synchronous."""
    model = ["model.n_layers=8", "model.d_model=512", "model.n_heads=8", "model.seq_len=128"]
    out_stats = {}
    with tempfile.TemporaryDirectory() as out:
        trainer = trainer_for(out, "parallel.backend=fsdp", "train.max_steps=3", *model)
        trainer.train_step()  # optimizer states exist
        manager = next(cb.manager for cb in trainer.callbacks.items if hasattr(cb, "manager"))
        args = (
            trainer.backend,
            trainer.run.state_dict(),
            trainer.setup.identity,
            trainer.setup.config_yaml,
        )
        nbytes = sum(t.numel() * t.element_size() for _, t in trainer.backend.state_tensors())
        sync, stall = [], []
        for round_ in range(3):
            start = time.perf_counter()
            manager.save(10 + 2 * round_, *args, async_ok=False)
            sync.append(time.perf_counter() - start)
            start = time.perf_counter()
            manager.save(11 + 2 * round_, *args, async_ok=True)
            stall.append(time.perf_counter() - start)
            manager.finish_pending()
        trainer.callbacks.close()
        out_stats = {
            "state_mb": nbytes / 2**20,
            "sync_s": min(sync),
            "async_stall_s": min(stall),
            "ratio": min(stall) / min(sync),
        }
    shutdown(clean=False)
    return out_stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=100, help="one injected fault per N steps")
    args = parser.parse_args()
    if args.every <= 50:
        # A fault within resilience.window (50) steps of the last rollback is a repeat: the
        # ladder goes one snapshot further back, which is not what this measures.
        parser.error("--every must exceed resilience.window (50 steps)")
    result = {
        "recovery": [recovery_time("memory"), recovery_time("disk")],
        "wall": wall_time(args.steps, args.every),
        "checkpoint": checkpoint_stall(),
    }
    for r in result["recovery"]:
        print(
            f"rollback from {r['source']}: restore {r['restore_s'] * 1e3:.0f} ms, to the first "
            f"resumed step {r['to_first_resumed_step_s'] * 1e3:.0f} ms (to step {r['restored_to_step']})"
        )
    w = result["wall"]
    print(
        f"{w['steps']} steps, one NaN per {w['fault_every']}: {w['faulty_s']:.1f} s vs fault-free "
        f"{w['clean_s']:.1f} s = {w['ratio']:.3f}x (goal <= 1.10x)"
    )
    c = result["checkpoint"]
    print(
        f"checkpoint of {c['state_mb']:.0f} MB: synchronous {c['sync_s']:.2f} s, async stall "
        f"{c['async_stall_s']:.3f} s = {c['ratio']:.2f} of it (goal <= 0.10)"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
