"""Shared fixtures: a small real corpus (two Shakespeare plays) and a micro model config."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from bigtrain.config import Config, load_config
from bigtrain.data.text.corpus import shakespeare_files, strip_play_markup

ROOT = Path(__file__).resolve().parents[1]

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two workers on two cores, each often beside the processes of another test: one intra-op
    # thread per process. With torch's default (a thread per core) OpenMP's threads wait for each
    # other on a busy machine: a 200-step run in the worker took 68 s beside two busy processes
    # against 13 s on one thread. The processes the tests start inherit the setting.
    import torch

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
TEST_KINDS = ("unit", "distributed", "e2e")  # the markers of pyproject.toml


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: a test without a kind is never hidden
def pytest_collection_modifyitems(config, items) -> None:
    """Every test is exactly one of: `unit` (runs in this process; no training loop, no process
    group; a stand-in helper process such as a sleeper for a live pid is fine), `distributed`
    (spawns a process group: run_distributed, torchrun, the deepspeed launcher, SLURM tasks;
    also when it trains end to end), `e2e` (a training loop or a whole run in this process, or
    the CLI, a script or a tool in a subprocess)."""
    wrong = []
    for item in items:
        kinds = sorted({m.name for m in item.iter_markers() if m.name in TEST_KINDS})
        if len(kinds) != 1:
            wrong.append(f"  {item.nodeid}: {', '.join(kinds) or 'no kind'}")
    if wrong:
        raise pytest.UsageError(
            "each test needs exactly one of the markers "
            + ", ".join(f"@pytest.mark.{k}" for k in TEST_KINDS)
            + " (module-wide: pytestmark = pytest.mark.unit):\n"
            + "\n".join(wrong)
        )
    items.sort(key=lambda item: LONGEST_FIRST.get(item.nodeid.split("::")[0], len(LONGEST_FIRST)))


LONGEST_FIRST = {
    name: i
    for i, name in enumerate(
        [
            "tests/parallel/test_ft.py",
            "tests/test_bench_detection.py",
            "tests/precision/test_engine.py",
            "tests/precision/test_int8.py",
            "tests/checkpoint/test_export_cli.py",
            "tests/parallel/test_tensor_parallel.py",
            "tests/resilience/test_backends.py",
            "tests/checkpoint/test_async.py",
            "tests/parallel/test_sharding.py",
            "tests/test_slurm.py",
            "tests/test_launchers.py",
            "tests/parallel/test_pipeline.py",
            "tests/parallel/test_experts.py",
            "tests/callbacks/test_rollback.py",
            "tests/parallel/test_context.py",
            "tests/precision/test_fp8_layouts.py",
            "tests/callbacks/test_heal.py",
            "tests/parallel/test_hsdp.py",
            "tests/parallel/test_equivalence.py",
            "tests/checkpoint/test_universal.py",
            "tests/precision/test_fp8.py",
            "tests/checkpoint/test_manager.py",
            "tests/test_train.py",
            "tests/parallel/test_zero_init.py",
            "tests/parallel/test_hf_family_layouts.py",
            "tests/checkpoint/test_init_from.py",
            "tests/parallel/test_tp_hf_gpt2.py",
            "tests/test_e2e.py",
            "tests/parallel/test_apply.py",
            "tests/resilience/test_recovery.py",
            "tests/monitor/test_stats.py",
            "tests/parallel/test_tp_hf.py",
            "tests/store/test_runlock.py",
            "tests/plan/test_sections_agree.py",
            "tests/plan/test_goodput.py",
            "tests/parallel/test_layout.py",
            "tests/data/test_mixture_run.py",
            "tests/precision/test_int8_tp.py",
            "tests/data/test_prepare.py",
            "tests/resilience/test_suspicion.py",
            "tests/telemetry/test_sinks.py",
        ]
    )
}
"""The modules whose tests take longest (`--durations`), longest first (those under ~8 s after
them, in collection order): the suite runs on two workers
(pyproject's `-n 2 --dist loadfile`, a module's tests on one worker so that its shared runs are
made once), and starting the longest modules first keeps one worker from running a long one
alone at the end. The replica-group and SLURM modules mostly wait (heartbeats, drills' sleeps,
slurmctld), as do the hang tests of test_heal.py: they stand apart in this list (the replica
groups first, SLURM once they are about done, the hangs after SLURM), so that each overlaps the
other worker's computing, not the other's waiting. A stable
sort: the rest keep their order. (xdist would otherwise hand out the modules with the most tests
first: pyproject's `--no-loadscope-reorder` keeps this order.)"""


DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


@pytest.fixture(autouse=True)
def restore_bigtrain_logging():
    """A test that calls the CLI's main in this process gets its console handler, bound to that
    test's captured stdout: once the capture is closed, every later record would fail to print
    ("Logging error ... I/O operation on closed file") in whichever test comes next on the
    worker. The "bigtrain" logger's handlers and level are restored after each test."""
    logger = logging.getLogger("bigtrain")
    handlers, level = list(logger.handlers), logger.level
    yield
    logger.handlers[:], logger.level = handlers, level


@pytest.fixture(autouse=True)
def restore_launcher_env():
    """A sharded run in this process sets MASTER_PORT for its process group of one (and one that
    fails during setup keeps that group's store listening): later subprocesses, SLURM jobs among
    them, would inherit a port that is taken. The launcher variables are restored after each test."""
    saved = {k: os.environ.get(k) for k in DIST_ENV}
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One token cache for the whole session: each corpus is tokenized once."""
    return tmp_path_factory.mktemp("bigtrain-cache")


@pytest.fixture(scope="session")
def corpus_files(tmp_path_factory) -> list[Path]:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def write_corpus(root: Path) -> list[Path]:
    """Two plays as plain text files under `root` (about 230 KB of real text): the micro runs'
    corpus (tests, and benches that train the micro model)."""
    files = []
    for src in shakespeare_files()[:2]:
        dst = root / (src.stem + ".txt")
        dst.write_text(strip_play_markup(src.read_text()))
        files.append(dst)
    return files


def micro_overrides(out_dir: Path, corpus_files: list[Path], cache_dir: Path) -> list[str]:
    paths = "[" + ",".join(str(p) for p in corpus_files) + "]"
    return [
        f"train.out_dir={out_dir}",
        "data.source=files",
        f"data.paths={paths}",
        f"data.cache_dir={cache_dir}",
        "data.vocab_size=384",
        "model.n_layers=2",
        "model.n_heads=2",
        "model.d_model=64",
        "model.seq_len=32",
        "train.micro_batch_size=8",
        "train.max_steps=20",
        "train.log_every=5",
        "train.eval_every=10",
        "train.eval_batches=2",
        "train.progress=false",
        "optim.lr=3e-3",
        "optim.warmup_steps=5",
        "checkpoint.every=10",
        "wandb.mode=disabled",
    ]


@pytest.fixture
def micro(tmp_path, corpus_files, cache_dir):
    """micro(*overrides) -> Config of a micro GPT on the test corpus, out_dir under tmp_path."""

    def make(*overrides: str, out: str = "run") -> Config:
        return load_config(
            [], micro_overrides(tmp_path / out, corpus_files, cache_dir) + list(overrides)
        )

    return make


@pytest.fixture
def micro_args(tmp_path, corpus_files, cache_dir):
    def make(*overrides: str, out: str = "run") -> list[str]:
        return micro_overrides(tmp_path / out, corpus_files, cache_dir) + list(overrides)

    return make


IN_PROCESS = {"plan", "config", "report", "ckpt", "export", "generate", "prepare"}
"""Commands that neither start a process group nor install signal handlers: `run_cli` runs them
through `bigtrain.cli.main` in the test's own process (a fresh interpreter costs ~3 s of imports
each), with the same arguments, exit code, stdout and stderr."""


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 600, fresh: bool = False
) -> subprocess.CompletedProcess:
    """`python -m bigtrain ARGS` from the repository root: in a fresh process for `train` (and
    with `fresh`), else through the same `main` in this process (IN_PROCESS)."""
    if not fresh and args and args[0] in IN_PROCESS:
        return _cli_in_process(list(args), env or {})
    full_env = {**os.environ, "WANDB_SILENT": "true", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "bigtrain", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
    )


def _cli_in_process(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """`bigtrain.cli.main(args)` with stdout and stderr captured, `env` set, the cwd the
    repository root, and the console logging it sets up taken down again."""
    from bigtrain.cli import main

    logger = logging.getLogger("bigtrain")
    handlers, level = list(logger.handlers), logger.level
    out, err = io.StringIO(), io.StringIO()
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with contextlib.chdir(ROOT), redirect_stdout(out), redirect_stderr(err):
            try:
                code = main(args)
            except SystemExit as e:  # argparse's usage errors
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        logger.handlers[:], logger.level = handlers, level
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


SLOW_WRITER = """
import os, threading, time
import bigtrain.checkpoint.state as state

def slow(original):
    def write(*args, **kwargs):
        written = original(*args, **kwargs)
        if threading.current_thread().name.startswith("bigtrain-ckpt-write"):
            time.sleep(float(os.environ["BIGTRAIN_TEST_WRITE_DELAY_S"]))
        return written
    return write

state.write = slow(state.write)  # every backend's writer (checkpoint/state.py)
"""


def slow_writer_env(tmp_path: Path, seconds: float) -> dict[str, str]:
    """Environment for run_cli in which background checkpoint writes stall for `seconds` after
    their files: a checkpoint is then reliably still in flight."""
    patch = tmp_path / "slow-writer"
    patch.mkdir(exist_ok=True)
    (patch / "sitecustomize.py").write_text(SLOW_WRITER)
    return {"PYTHONPATH": f"{patch}:{ROOT}", "BIGTRAIN_TEST_WRITE_DELAY_S": str(seconds)}


def run_in_triton_interpreter(module: str) -> dict:
    """`python -m module` under TRITON_INTERPRET=1 (the interpreter is chosen when a kernel is
    defined, so it needs a process of its own); its last output line, as JSON."""
    result = subprocess.run(
        [sys.executable, "-m", module],
        cwd=ROOT,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])
