"""Memory: peak use per rank, CUDA allocator history and snapshots (CPU-side with torch.cuda's
functions stood in for; on a real GPU where one is present), and the out-of-memory path: an `oom`
event with the bytes and `bigtrain plan`'s prediction, a clear message and exit 8."""

from __future__ import annotations

import pickle
import resource
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from bigtrain import cli
from bigtrain.errors import OutOfMemory
from bigtrain.parallel.backends.local import LocalBackend
from bigtrain.store.rundir import RunDir, read_jsonl
from bigtrain.telemetry import memory

CUDA = torch.device("cuda", 0)
NEEDS_CUDA = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device (the allocator's history and snapshots exist only there)",
)


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's memory functions stood in for: what bigtrain asks and records."""
    calls = []
    stats = {"memory_allocated": 3 * 2**30, "memory_reserved": 4 * 2**30}
    stats["max_memory_allocated"] = 5 * 2**30
    for name, value in stats.items():
        monkeypatch.setattr(torch.cuda, name, lambda device=None, v=value: v)

    def dump(path):
        calls.append(("dump", path))
        Path(path).write_bytes(pickle.dumps({"segments": []}))

    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", dump)
    monkeypatch.setattr(
        torch.cuda.memory, "_record_memory_history", lambda *a, **k: calls.append(("history", k))
    )
    return calls


@pytest.mark.unit
def test_peak_memory_is_cuda_max_allocated_or_host_rss():
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert memory.peak_memory_bytes(torch.device("cpu")) >= rss > 0
    assert memory.memory_kind(torch.device("cpu")) == "host_max_rss"


@pytest.mark.unit
def test_cuda_peak_history_and_snapshot_through_torch_cuda(fake_cuda, tmp_path):
    assert memory.peak_memory_bytes(CUDA) == 5 * 2**30
    assert memory.start_history(CUDA) and fake_cuda[-1] == ("history", {"max_entries": 200_000})
    memory.stop_history()
    assert fake_cuda[-1] == ("history", {"enabled": None})
    assert not memory.start_history(torch.device("cpu"))  # a logged note, nothing recorded
    report = memory.oom_report(CUDA, tmp_path, rank=1)
    assert report["allocated_bytes"] == 3 * 2**30 and report["reserved_bytes"] == 4 * 2**30
    assert report["snapshot"] == str(tmp_path / "memory" / "rank1.oom.pickle")
    assert pickle.loads(Path(report["snapshot"]).read_bytes()) == {"segments": []}


@pytest.mark.unit
def test_an_oom_on_cuda_names_bytes_plan_and_snapshot(fake_cuda, tmp_path):
    events = []
    run_dir = RunDir(tmp_path, is_main=False)  # rank 1: the event is written all the same

    def event(kind, any_rank=False, **details):
        events.append(run_dir.event(4, kind, any_rank=any_rank, **details))
        return events[-1]

    events_sink = SimpleNamespace(event=event)
    plan = {"total_bytes": 6 * 2**30, "states_bytes": 2**30}
    error = memory.out_of_memory(
        events_sink, CUDA, tmp_path, 1, torch.OutOfMemoryError("CUDA out of memory."), lambda: plan
    )
    assert isinstance(error, OutOfMemory) and error.exit_code == 8
    assert "rank 1 ran out of memory on cuda:0 at step 4 (allocated 3.00 GiB" in str(error)
    assert "bigtrain plan predicted 6.00 GiB per rank" in str(error)
    assert "rank1.oom.pickle" in str(error)
    (written,) = read_jsonl(tmp_path / "events.jsonl")
    assert written["kind"] == "oom" and written["rank"] == 1 and written["plan"] == plan
    assert written["reserved_bytes"] == 4 * 2**30 and written["error"] == "CUDA out of memory."


@pytest.mark.e2e
def test_an_oom_in_a_cpu_run_writes_the_event_and_exits_8(micro_args, monkeypatch, capsys):
    forward_backward = LocalBackend.forward_backward

    def allocate(self, x, y, i, n):  # the allocator fails at step 3's first micro-batch
        if self.num_calls == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        self.num_calls += 1
        return forward_backward(self, x, y, i, n)

    monkeypatch.setattr(LocalBackend, "num_calls", 0, raising=False)
    monkeypatch.setattr(LocalBackend, "forward_backward", allocate)
    args = micro_args("train.max_steps=6")
    assert cli.main(["train", *args]) == 8
    err = capsys.readouterr().err
    assert "bigtrain: error: rank 0 ran out of memory on cpu at step 3" in err
    assert "bigtrain plan predicted" in err and "Traceback" not in err
    out = Path(next(a for a in args if a.startswith("train.out_dir=")).split("=", 1)[1])
    (oom,) = [e for e in read_jsonl(out / "events.jsonl") if e["kind"] == "oom"]
    assert oom["step"] == 3 and oom["host_max_rss_bytes"] > 0 and "snapshot" not in oom
    assert oom["plan"]["total_bytes"] > oom["plan"]["states_bytes"] > 0
    assert oom["error"] == "CUDA out of memory. Tried to allocate 20.00 GiB"
    assert not (out / "final.json").exists()


@NEEDS_CUDA
@pytest.mark.e2e
def test_profile_memory_dumps_a_snapshot_on_cuda(micro):
    from bigtrain.parallel.env import DistEnv
    from bigtrain.runner import run

    cfg = micro(
        "train.max_steps=4", "train.device=cuda", "profile.steps=[2,3]", "profile.memory=true"
    )
    run(cfg, DistEnv())
    (event,) = [
        e for e in read_jsonl(Path(cfg.train.out_dir) / "events.jsonl") if e["kind"] == "profile"
    ]
    snapshot = pickle.loads(Path(event["memory_snapshot"]).read_bytes())
    assert snapshot["segments"] and any(t for t in snapshot["device_traces"])


@NEEDS_CUDA
@pytest.mark.e2e
def test_a_real_cuda_oom_dumps_the_snapshot_and_exits_8(micro_args, monkeypatch, capsys):
    free, _ = torch.cuda.mem_get_info()

    def allocate(self, x, y, i, n):  # a real allocation beyond the free memory
        return torch.empty(2 * free, dtype=torch.uint8, device=x.device)

    monkeypatch.setattr(LocalBackend, "forward_backward", allocate)
    args = micro_args("train.max_steps=2", "train.device=cuda")
    assert cli.main(["train", *args]) == 8
    out = Path(next(a for a in args if a.startswith("train.out_dir=")).split("=", 1)[1])
    (oom,) = [e for e in read_jsonl(out / "events.jsonl") if e["kind"] == "oom"]
    assert Path(oom["snapshot"]).is_file() and oom["step"] == 1
    assert "ran out of memory on cuda" in capsys.readouterr().err
