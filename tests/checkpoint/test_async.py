"""Asynchronous checkpoints on every backend: written in the background from a host copy,
committed at a later step, loadable only once committed."""

from __future__ import annotations

from pathlib import Path

import pytest

from bigtrain.build import build_trainer
from bigtrain.parallel.backends.local import LocalBackend
from bigtrain.parallel.env import DistEnv
from bigtrain.store.rundir import read_jsonl
from tests.conftest import micro_overrides, run_cli, slow_writer_env
from tests.distributed import run_distributed, train_run

WORLD = {"local": 1, "zero": 2, "fsdp": 2}


@pytest.mark.distributed
@pytest.mark.parametrize("backend", ["local", "zero"])
def test_async_checkpoint_commits_later_and_resumes_bit_exactly(
    tmp_path, corpus_files, cache_dir, backend
):
    opts = [
        f"parallel.backend={backend}",
        "train.max_steps=10",
        "train.eval_every=0",
        "checkpoint.every=5",
        "checkpoint.keep=5",
    ]

    def args(name: str, *extra: str) -> list[str]:
        return micro_overrides(tmp_path / name, corpus_files, cache_dir) + opts + list(extra)

    straight = run_distributed(train_run, WORLD[backend], args("straight"))[0]
    started = [e for e in straight["events"] if e["kind"] == "checkpoint_started"]
    committed = [e for e in straight["events"] if e["kind"] == "checkpoint"]
    assert [e["step"] for e in started] == [5]  # step 10 is the last: synchronous
    assert committed[0]["path"].endswith("step_00000005") and committed[0]["step"] > 5
    assert committed[-1]["path"].endswith("step_00000010") and committed[-1]["step"] == 10
    # Resume from the asynchronously written step-5 checkpoint: the same weights at step 10.
    step5 = tmp_path / "straight" / "checkpoints" / "step_00000005"
    resumed = run_distributed(
        train_run, WORLD[backend], args("resumed", f"checkpoint.resume={step5}")
    )
    assert resumed[0]["final"]["fingerprint"] == straight["final"]["fingerprint"]


@pytest.mark.e2e
@pytest.mark.parametrize("backend", ["local", "zero"])
def test_sigkill_during_the_background_write_never_loads_it(micro_args, tmp_path, backend):
    """The step-5 checkpoint is still being written (its writer is held after the first file)
    when the process is SIGKILLed at step 6. The restart never loads the half-written one."""
    args = micro_args(
        f"parallel.backend={backend}",
        "train.max_steps=8",
        "checkpoint.every=5",
        "train.eval_every=0",
        "drill.kill_step=6",
    )
    result = run_cli("train", *args, env=slow_writer_env(tmp_path, 60))
    assert result.returncode == -9, result.stderr[-2000:]
    root = tmp_path / "run" / "checkpoints"
    assert [p.name for p in root.iterdir()] == [".tmp-step_00000005"]
    assert not (root / ".tmp-step_00000005" / "manifest.json").exists()
    again = run_cli("train", *args)
    assert again.returncode == 0, again.stderr[-2000:]
    kinds = [e["kind"] for e in read_jsonl(tmp_path / "run" / "events.jsonl")]
    assert "resume" not in kinds  # nothing was committed: it started over
    assert sorted(p.name for p in root.iterdir()) == ["step_00000005", "step_00000008"]


@pytest.mark.e2e
def test_a_checkpoint_at_a_snapshot_step_writes_from_the_snapshot(micro, monkeypatch):
    """The rollback snapshot is already a host copy of the state: a checkpoint of the same step
    (asynchronous or not) writes from it instead of copying again."""
    calls = []
    original = LocalBackend.local_state

    def counted(self):
        calls.append(1)
        return original(self)

    monkeypatch.setattr(LocalBackend, "local_state", counted)
    cfg = micro(
        "train.max_steps=10",
        "checkpoint.every=5",
        "resilience.snapshot_every=5",
        "train.eval_every=0",
    )
    trainer = build_trainer(cfg, DistEnv())
    trainer.fit()
    trainer.callbacks.close()
    # the starting state (a rollback target) and the snapshots of steps 5 and 10; the checkpoints
    # of steps 5 and 10 reused those
    assert len(calls) == 3
    ckpts = sorted(p.name for p in (Path(cfg.train.out_dir) / "checkpoints").iterdir())
    assert ckpts == ["step_00000005", "step_00000010"]
