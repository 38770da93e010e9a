"""Profiler traces (profile.*): the window's schedule, a profiled CPU run's Chrome trace with the
loop's phases, and no profiler object at all when profiling is off."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from bigtrain.config.telemetry import ProfileConfig
from bigtrain.parallel.env import DistEnv
from bigtrain.runner import run
from bigtrain.store.rundir import read_jsonl
from bigtrain.telemetry.profile import PHASES, Window, profile_window, trace_path
from tests.conftest import micro_overrides
from tests.distributed import run_distributed, train_run


@pytest.mark.unit
def test_the_window_counts_from_the_first_step_this_process_runs():
    cfg = ProfileConfig(steps=[20, 23], warmup=2)
    assert profile_window(cfg, 0) == Window(20, 23, wait=17, warmup=2)  # steps 1..17 wait
    assert profile_window(cfg, 18) == Window(20, 23, wait=0, warmup=1)  # resumed at 18
    assert profile_window(cfg, 21) == Window(22, 23, wait=0, warmup=0)  # inside the window
    assert profile_window(cfg, 23) is None and profile_window(ProfileConfig(), 0) is None
    window = profile_window(cfg, 0)
    assert window.active == 4 and window.first_step == 18
    assert trace_path(Path("r"), 1, window, gzip=True) == Path(
        "r/profile/rank1.20.pt.trace.json.gz"
    )


@pytest.mark.e2e
def test_a_profiled_cpu_run_writes_a_chrome_trace_with_the_loop_phases(micro):
    cfg = micro(
        "train.max_steps=8",
        "profile.steps=[4,5]",
        "profile.record_shapes=true",
        "resilience.snapshot_every=2",  # a snapshot (checkpoint copy) inside the window
        "checkpoint.every=5",
    )
    final = run(cfg, DistEnv())
    out = Path(cfg.train.out_dir)
    (event,) = [e for e in read_jsonl(out / "events.jsonl") if e["kind"] == "profile"]
    assert event["step"] == 5 and event["rank"] == 0 and event["steps"] == [4, 5]
    trace = json.loads(Path(event["trace"]).read_text())
    assert Path(event["trace"]).parent == out / "profile"
    names = {e.get("name") for e in trace["traceEvents"]}
    assert set(PHASES) <= names and "checkpoint_save" in names
    steps = sorted(n for n in names if str(n).startswith("ProfilerStep#"))
    assert steps == ["ProfilerStep#4", "ProfilerStep#5"]  # bigtrain's step numbers, no warm-up
    assert any(e.get("args", {}).get("Input Dims") for e in trace["traceEvents"])  # shapes
    # Peak memory per rank: in final.json, and in the metrics at log steps.
    assert final["peak_memory_kind"] == "host_max_rss" and final["peak_memory_bytes_by_rank"][0] > 0
    logged = [m for m in read_jsonl(out / "metrics.jsonl") if "loss" in m]
    assert all(m["peak_memory_bytes"] > 2**20 for m in logged)


@pytest.mark.e2e
def test_profiling_off_creates_no_profiler_objects(micro, monkeypatch):
    made = []

    def refuse(name):
        def make(*args, **kwargs):
            made.append(name)
            raise AssertionError(f"{name} made with profiling off")

        return make

    monkeypatch.setattr(torch.profiler, "profile", refuse("profile"))
    monkeypatch.setattr(torch.profiler, "record_function", refuse("record_function"))
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", refuse("history"))
    cfg = micro("train.max_steps=3")
    assert run(cfg, DistEnv())["step"] == 3 and made == []
    assert not (Path(cfg.train.out_dir) / "profile").exists()
    # A profile window on another rank only: this rank makes nothing either.
    cfg = micro("train.max_steps=3", "profile.steps=[1,2]", "profile.ranks=[1]", out="other")
    assert run(cfg, DistEnv())["step"] == 3 and made == []


@pytest.mark.distributed
def test_each_profiling_rank_writes_its_trace_and_event(tmp_path, corpus_files, cache_dir):
    args = micro_overrides(tmp_path / "fsdp", corpus_files, cache_dir) + [
        "parallel.backend=fsdp",
        "train.max_steps=4",
        "checkpoint.every=-1",
        "profile.steps=[2,3]",
        "profile.ranks=[0,1]",
        "profile.gzip=true",
    ]
    r0, _ = run_distributed(train_run, 2, args)
    events = sorted((e for e in r0["events"] if e["kind"] == "profile"), key=lambda e: e["rank"])
    assert [(e["rank"], e["step"], e["steps"]) for e in events] == [(0, 3, [2, 3]), (1, 3, [2, 3])]
    for rank, event in enumerate(events):
        assert event["trace"] == str(
            tmp_path / "fsdp" / "profile" / f"rank{rank}.2.pt.trace.json.gz"
        )
        trace = json.loads(gzip.decompress(Path(event["trace"]).read_bytes()))
        names = {e.get("name") for e in trace["traceEvents"]}
        assert {"forward_backward", "monitor", "optimizer"} <= names
