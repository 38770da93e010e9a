"""Memory: peak use per rank (metrics, final.json), CUDA allocator history and snapshots
(`profile.memory`), and what an out-of-memory error leaves behind.

Peak use is CUDA's max allocated bytes on a GPU (the caching allocator's own count: a host query,
no device sync), and the process's peak resident set size on a CPU (getrusage; psutil's peak
working set where `resource` is missing). A snapshot (torch.cuda.memory._dump_snapshot) is a
pickle that https://pytorch.org/memory_viz draws: every live block, and with history recording on,
every allocation and free with its stack.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bigtrain.errors import OutOfMemory
from bigtrain.state.events import Events

logger = logging.getLogger(__name__)

HISTORY_ENTRIES = 200_000  # allocator events kept while recording (a ring)
OOM_FOLDER = "memory"


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory so far: CUDA max allocated on a GPU, peak host RSS elsewhere."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return host_peak_rss()


def host_peak_rss() -> int:
    try:
        import resource
    except ImportError:  # Windows
        import psutil

        return int(getattr(psutil.Process().memory_info(), "peak_wset", 0))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # Linux counts KiB


def memory_kind(device: torch.device) -> str:
    """What peak_memory_bytes measures on `device` (final.json says so beside the numbers)."""
    return "cuda_max_allocated" if device.type == "cuda" else "host_max_rss"


def device_bytes(device: torch.device) -> dict[str, int]:
    """Allocated and reserved bytes now (CUDA), or this process's peak RSS (CPU)."""
    if device.type == "cuda":
        return {
            "allocated_bytes": int(torch.cuda.memory_allocated(device)),
            "reserved_bytes": int(torch.cuda.memory_reserved(device)),
            "max_allocated_bytes": int(torch.cuda.max_memory_allocated(device)),
        }
    return {"host_max_rss_bytes": host_peak_rss()}


def start_history(device: torch.device) -> bool:
    """Record the CUDA allocator's history from now on; False (and a logged reason) elsewhere."""
    if device.type != "cuda":
        logger.info(
            "profile.memory: no allocator history on %s (CUDA only); peak host RSS is in the "
            "metrics as always",
            device,
        )
        return False
    torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES)
    return True


def stop_history() -> None:
    torch.cuda.memory._record_memory_history(enabled=None)


def dump_snapshot(path: Path) -> Path:
    """The allocator's snapshot (with the history recorded so far) as a pickle at `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.cuda.memory._dump_snapshot(str(path))
    return path


def oom_report(device: torch.device, run_dir: Path, rank: int) -> dict[str, Any]:
    """An out-of-memory error's details for the `oom` event: the bytes in use and, on CUDA, the
    snapshot dumped to RUN_DIR/memory/rank<r>.oom.pickle. Never raises: it runs while an error is
    on its way out."""
    report: dict[str, Any] = {"rank": rank, "device": str(device)}
    try:
        report.update(device_bytes(device))
        if device.type == "cuda":
            snapshot = dump_snapshot(run_dir / OOM_FOLDER / f"rank{rank}.oom.pickle")
            report["snapshot"] = str(snapshot)
    except Exception as e:  # noqa: BLE001 - the report must not hide the OOM itself
        report["report_error"] = f"{type(e).__name__}: {e}"
    return report


def out_of_memory(
    events: Events,
    device: torch.device,
    run_dir: Path,
    rank: int,
    error: BaseException,
    memory_plan: Callable[[], dict[str, Any]] | None = None,
) -> OutOfMemory:
    """The `oom` event (from this rank, `rank`) and the error that ends the run with exit 8, for
    an out-of-memory `error` raised on `device` in the run at `run_dir`. `memory_plan`: a function
    returning `bigtrain plan`'s prediction for the config (bigtrain/plan/footprint.py, above this
    layer)."""
    report = oom_report(device, run_dir, rank)
    plan: dict[str, Any] | None = None
    if memory_plan is not None:
        try:
            plan = memory_plan()
        except Exception as e:  # noqa: BLE001 - the prediction must not hide the OOM itself
            plan = {"error": f"{type(e).__name__}: {e}"}
    first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
    record = events.event("oom", any_rank=True, **report, plan=plan, error=first_line[:500])
    used = ", ".join(
        f"{k.removesuffix('_bytes')} {fmt_gib(v)}"
        for k, v in report.items()
        if k.endswith("_bytes")
    )
    predicted = (
        f"; bigtrain plan predicted {fmt_gib(plan['total_bytes'])} per rank"
        if plan and "total_bytes" in plan
        else ""
    )
    snapshot = f"; allocator snapshot: {report['snapshot']}" if "snapshot" in report else ""
    return OutOfMemory(
        f"rank {rank} ran out of memory on {device} at step {record['step']} ({used})"
        f"{predicted}{snapshot}; the `oom` event in {run_dir / 'events.jsonl'} has "
        "the details. Lower train.micro_batch_size, use parallel.activation_checkpointing or "
        "shard more (bigtrain plan shows what fits)"
    )


def fmt_gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"
