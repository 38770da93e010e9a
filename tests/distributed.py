"""run_distributed(fn, world_size, *args): fn(*args) in world_size spawned processes on gloo.

Each process gets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT as torchrun would set them;
fn must be a module-level function (spawn pickles it by name). Returns [result of rank 0, ...];
an exception in any rank fails the call with that rank's traceback."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch.multiprocessing as mp

from bigtrain.parallel.env import free_port


def _worker(rank: int, fn, world_size: int, port: int, out_dir: str, args: tuple) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    import torch

    torch.set_num_threads(1)  # two ranks on two cores
    try:
        result = ("ok", fn(*args))
    except BaseException:  # report to the parent, which fails the test with it
        result = ("error", traceback.format_exc())
    with open(Path(out_dir) / f"{rank}.pkl", "wb") as f:
        pickle.dump(result, f)
    # Skip interpreter teardown: native threads of DeepSpeed/gloo sometimes abort in their
    # destructors after a spawned child's work is done ("terminate called without an active
    # exception"), which says nothing about the code under test. The CLI's own exit codes are
    # checked through the real launchers in tests/test_launchers.py.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


PORT_TAKEN = "EADDRINUSE"
"""In a rank's error: its rendezvous port was taken between free_port() and the store's bind (by
another test's process): the launch is tried again on a new port."""


def run_distributed(fn, world_size: int, *args, timeout: float | None = None, attempts: int = 3):
    # Ranks fork from a server that imported torch, bigtrain and DeepSpeed once (forkserver: the
    # server itself never ran a thread or an OpenMP region, so forking it is safe).
    multiprocessing.set_forkserver_preload(["tests.distributed_preload"])
    for attempt in range(1, attempts + 1):
        outcomes = _launch(fn, world_size, args, timeout)
        errors = [
            f"rank {rank} failed:\n{value}"
            for rank, (status, value) in enumerate(outcomes)
            if status == "error"
        ]
        if errors and attempt < attempts and any(PORT_TAKEN in e for e in errors):
            continue
        if errors:
            raise AssertionError("\n".join(errors))
        return [value for _, value in outcomes]
    raise AssertionError("unreachable")


def _launch(fn, world_size: int, args: tuple, timeout: float | None) -> list[tuple[str, object]]:
    """Every rank's (status, value). A rank that fails ends the others at once (they would wait
    for it in their next collective until the process-group timeout); so does `timeout` seconds
    (None: no limit, as for a long benchmark)."""
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(
            _worker,
            args=(fn, world_size, free_port(), out_dir, args),
            nprocs=world_size,
            join=False,
            start_method="forkserver",
        )
        results = Path(out_dir)
        deadline = time.monotonic() + timeout if timeout is not None else float("inf")
        failed = None
        while failed is None and not _joined(context):
            failed = next((r for r in range(world_size) if _status(results, r) == "error"), None)
            if time.monotonic() > deadline:
                failed = -1
        if failed is not None:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                process.join()
        why = {
            None: "exited without a result (a signal or a crash)",
            -1: f"timed out ({timeout} s)",
        }.get(failed, f"ended after rank {failed} failed")
        return [
            pickle.loads((results / f"{rank}.pkl").read_bytes())
            if (results / f"{rank}.pkl").exists()
            else ("error", why)
            for rank in range(world_size)
        ]


def _joined(context) -> bool:
    """Every rank has exited (torch's join, one second at a time; a rank that died by a signal
    ends the wait as well: its result file says what it knew)."""
    try:
        return context.join(timeout=1.0)
    except mp.ProcessExitedException:
        return True


def _status(results: Path, rank: int) -> str | None:
    path = results / f"{rank}.pkl"
    try:
        return pickle.loads(path.read_bytes())[0] if path.exists() else None
    except (EOFError, pickle.UnpicklingError):  # still being written
        return None


def train_run(args: list[str], files: tuple[str, ...] = ()) -> dict:
    """A whole run of `bigtrain.runner.run` on config `files` and overrides `args` (in a rank);
    its final.json data, events and metrics."""
    from bigtrain.config import load_config
    from bigtrain.parallel.env import read_env
    from bigtrain.runner import run
    from bigtrain.store.rundir import read_jsonl

    cfg = load_config(list(files), args)
    final = run(cfg, read_env())
    out = Path(cfg.train.out_dir)
    return {
        "final": final,
        "events": read_jsonl(out / "events.jsonl"),
        "metrics": read_jsonl(out / "metrics.jsonl"),
    }


def train_run_probed(args: list[str], probe) -> dict:
    """train_run, plus `probe(trainer)` (a module-level function: it travels to spawned ranks by
    name) called on the trainer once it is built, before the first step: its result is
    `result["probe"]`. One run serves both the layout checks and the training checks."""
    import bigtrain.runner as runner

    seen: dict = {}
    build = runner.build

    def probed(cfg, env):
        built = build(cfg, env)
        seen.update(probe(built.trainer))
        return built

    runner.build = probed
    try:
        return {**train_run(args), "probe": seen}
    finally:
        runner.build = build


def mesh_run_args(tmp: Path, name: str, corpus_files, cache_dir, *extra: str) -> list[str]:
    """Overrides of a micro-model run under tmp/name that is compared across meshes: FP32, a
    global batch of 16 at any world size, loss and norm logged every step, no evaluation or
    checkpoints unless `extra` asks, and clipping below the micro model's norms (so every step
    clips with the monitor's norm)."""
    from tests.conftest import micro_overrides

    return micro_overrides(tmp / name, corpus_files, cache_dir) + [
        "train.log_every=1",
        "train.eval_every=0",
        "checkpoint.every=0",
        "precision.compute_dtype=fp32",
        "train.global_batch_size=16",
        "optim.grad_clip=0.05",
        *extra,
    ]


def step0_fingerprint(trainer) -> dict:
    """A train_run_probed probe: the weights' fingerprint before the first step."""
    return {"fingerprint": trainer.backend.fingerprint()}


def by_step(result: dict, key: str) -> dict[int, float]:
    """`key` of each metrics line of a train_run result, by step."""
    return {m["step"]: m[key] for m in result["metrics"] if key in m}


def initial_fingerprint(args: list[str]) -> str:
    """The weight fingerprint of a run built from `args`, before any step (in a rank)."""
    from bigtrain.build import build_trainer
    from bigtrain.config import load_config
    from bigtrain.parallel.env import read_env, shutdown

    trainer = build_trainer(load_config([], args), read_env())
    try:
        return trainer.backend.fingerprint()
    finally:
        trainer.callbacks.close()
        shutdown(clean=False)


def resume_copies(
    root: Path, stopped: str, targets, make_args, straight: dict, steps=(5, 6, 7)
) -> None:
    """For each (name, world_size, overrides) in `targets`: copy the stopped run directory
    root/stopped to root/name, resume it there with make_args(name, *overrides), and check that it
    resumed and that the losses of `steps` follow the uninterrupted run `straight` (1e-4)."""
    import shutil

    import pytest

    for name, world, extra in targets:
        shutil.copytree(root / stopped, root / name)
        resumed = run_distributed(train_run, world, make_args(name, *extra))[0]
        assert "resume" in [e["kind"] for e in resumed["events"]], name
        before, after = by_step(straight, "loss"), by_step(resumed, "loss")
        for step in steps:
            assert after[step] == pytest.approx(before[step], rel=1e-4), (name, step)
