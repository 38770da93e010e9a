"""The metrics logger's MFU and the console's ETA against a stub trainer: MFU is what the logged
steps' own times allow on every device that read the batch (replica groups included); the ETA
is the rate of the steps this process ran, whatever step it started at."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from bigtrain.callbacks import metrics
from bigtrain.callbacks.metrics import ConsoleProgress, MetricsLogger
from bigtrain.config.schema import Config
from bigtrain.data.read.stream import SampleStream
from bigtrain.parallel.env import DistEnv
from bigtrain.parallel.layout import Layout
from bigtrain.state.run import Counters
from bigtrain.store.rundir import RunDir, read_jsonl
from bigtrain.train.step import StepResult

pytestmark = pytest.mark.unit

SEQ_LEN, FLOPS_PER_TOKEN, PEAK = 128, 7e6, 1e12


def stub(path: Path, max_steps: int, groups: int = 1, world_size: int = 1, batch: int = 48):
    """What MetricsLogger and ConsoleProgress read of a Trainer: `batch` sequences per step over
    the job's `world_size` ranks and its `groups` replica groups (rank 0 of group 0)."""
    cfg = Config()
    cfg.train.max_steps, cfg.train.log_every, cfg.model.seq_len = max_steps, 1, SEQ_LEN
    layout = Layout.of(cfg.parallel, world_size, 0, groups, 0)
    state = Counters()
    return SimpleNamespace(
        cfg=cfg,
        env=DistEnv(rank=0, world_size=world_size),
        run_dir=RunDir(path, True),
        state=state,
        device=torch.device("cpu"),
        loader=SimpleNamespace(stream=SampleStream(10_000, seed=0)),
        setup=SimpleNamespace(flops_per_token=FLOPS_PER_TOKEN, peak_flops=PEAK, layout=layout),
        tokens_per_step=batch * SEQ_LEN,
        step=0,
        end_step=max_steps,
        is_last_step=lambda: state.step >= max_steps,
    )


def run_step(trainer, callbacks, step_time: float) -> StepResult:
    trainer.state.step = trainer.step = trainer.step + 1
    result = StepResult(trainer.step, 1e-3, loss=2.5, grad_norm=1.0, step_time=step_time)
    for callback in callbacks:
        callback.on_step_end(trainer, result)
    return result


@pytest.mark.parametrize(("groups", "world_size"), [(1, 1), (1, 2), (3, 1), (2, 4)])
def test_mfu_is_what_the_step_time_allows_on_every_device(tmp_path, groups, world_size):
    """Each device's share of a step's tokens in the step's time, over the peak: 3 replica
    groups of one rank each once logged 3x that (the global batch over one group's device)."""
    trainer = stub(tmp_path, 6, groups, world_size)
    logger = MetricsLogger()
    for step_time in (0.5, 0.25, 0.25, 0.2, 0.3, 0.3):
        run_step(trainer, [logger], step_time)
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    devices = world_size * groups
    for record, step_time in zip(records, (0.5, 0.25, 0.25, 0.2, 0.3, 0.3), strict=True):
        tokens_per_device = 48 * SEQ_LEN / devices
        assert record["mfu"] == pytest.approx(
            FLOPS_PER_TOKEN * tokens_per_device / (step_time * PEAK), rel=1e-12
        )
        assert record["mfu"] == pytest.approx(
            FLOPS_PER_TOKEN * record["tokens_per_s"] / (PEAK * devices), rel=1e-12
        )


def test_mfu_of_an_interval_is_its_tokens_over_its_summed_step_times(tmp_path):
    trainer = stub(tmp_path, 10, groups=3)
    trainer.cfg.train.log_every = 5
    logger = MetricsLogger()
    times = [0.9, 0.1, 0.2, 0.3, 0.5]
    for step_time in times:
        run_step(trainer, [logger], step_time)
    (record,) = read_jsonl(tmp_path / "metrics.jsonl")
    assert record["tokens_per_s"] == pytest.approx(5 * 48 * SEQ_LEN / sum(times), rel=1e-12)
    assert record["mfu"] == pytest.approx(
        FLOPS_PER_TOKEN * 5 * 16 * SEQ_LEN / (sum(times) * PEAK), rel=1e-12
    )


def eta_of(line: str) -> int:
    h, m, s = re.search(r"eta (\d+):(\d\d):(\d\d)", line).groups()
    return int(h) * 3600 + int(m) * 60 + int(s)


def test_a_process_that_starts_at_step_29_of_80_gets_the_eta_of_its_own_steps(
    tmp_path, monkeypatch, capsys
):
    """A replica group that rejoins takes a peer's state at step 29 inside its first step: its
    ETA at step 30/80 is 50 steps at the pace of the one step it ran (10 s), not of 30 steps
    (once: 0:00:02)."""
    clock = [1000.0]
    monkeypatch.setattr(metrics.time, "monotonic", lambda: clock[0])
    trainer = stub(tmp_path, 80, groups=3)
    console, logger = ConsoleProgress(True), MetricsLogger()
    console.on_start(trainer)  # a fresh process: step 0
    assert console.bar is None  # stderr is no terminal: a line per logged step
    trainer.step = trainer.state.step = 29  # the peer's state, loaded in the step's quorum
    clock[0] += 10.0
    run_step(trainer, [logger, console], 10.0)
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("step 30/80") and "0:00:10 elapsed" in line
    assert eta_of(line) == 50 * 10
    clock[0] += 2.0
    run_step(trainer, [logger, console], 2.0)  # two steps in 12 s: 6 s a step
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("step 31/80") and eta_of(line) == 49 * 6


def test_a_resumed_process_and_stop_at_step_count_to_its_own_last_step(
    tmp_path, monkeypatch, capsys
):
    clock = [0.0]
    monkeypatch.setattr(metrics.time, "monotonic", lambda: clock[0])
    trainer = stub(tmp_path, 80)
    trainer.step = trainer.state.step = 40  # resumed from a checkpoint of step 40
    trainer.end_step = 60  # train.stop_at_step
    console, logger = ConsoleProgress(True), MetricsLogger()
    console.on_start(trainer)
    for _ in range(4):
        clock[0] += 0.5
        run_step(trainer, [logger, console], 0.5)
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("step 44/80") and eta_of(line) == 16 * 0.5
