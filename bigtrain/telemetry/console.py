"""What a run prints for people (rank 0's console): one formatted line per event that matters and
per logged step. events.jsonl and metrics.jsonl keep every field; the console says what happened,
with numbers in units people read (MB, seconds, h:mm:ss), never a Python repr.

    checkpoint step 100 -> runs/x/checkpoints/step_00000100 (13.5 MB/rank, stall 0.04 s)
    step 200/500  loss 5.1234  val 5.2001  lr 9.00e-04  12,345 tok/s  mfu 31.2%  0:01:10 elapsed  eta 0:01:45
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from bigtrain.checkpoint.manifest import PREFIX

Record = dict[str, Any]


def duration(seconds: float) -> str:
    """h:mm:ss."""
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def megabytes(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def _shown(value: Any) -> str:
    """A value as text: floats to 4 significant digits, lists comma-separated."""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list | tuple):
        return ", ".join(_shown(v) for v in value)
    return str(value)


def _checkpoint_step(path: str) -> int | None:
    name = Path(path).name
    return int(name[len(PREFIX) :]) if name.startswith(PREFIX) else None


def _checkpoint(r: Record) -> str:
    step = _checkpoint_step(r["path"])
    per_rank = r.get("bytes_per_rank") or [0]
    line = f"checkpoint step {step} -> {r['path']} ({megabytes(max(per_rank))}/rank, "
    line += f"stall {r.get('stall_s', 0.0):.2f} s"
    if r.get("async") and step is not None and step != r["step"]:
        line += f", written in the background, committed at step {r['step']}"
    return line + ")"


def _resume(r: Record) -> str:
    line = f"resume from {r['path']} (step {_checkpoint_step(r['path'])})"
    changes = r.get("changes") or {}
    if changes:
        shown = [f"{k} {_shown(old)} -> {_shown(new)}" for k, (old, new) in changes.items()]
        line += "; config changed: " + "; ".join(shown)
    if r.get("batch"):
        line += "; " + r["batch"]
    return line


def _anomaly(r: Record) -> str:
    what = {"nonfinite": "non-finite", "replica": "disagreeing replicas", "spike": "spike"}
    line = f"anomaly at step {r['step']}: {what.get(r.get('type'), r.get('type'))} {r['metric']}"
    line += f" = {_shown(r['value'])}"
    if r.get("threshold") is not None:
        line += f" (threshold {_shown(r['threshold'])}, baseline {_shown(r.get('baseline'))})"
    if r.get("tensor"):
        line += f", first in {r['tensor']}"
    return line + f"; action: {r['action']}"


def _rollback(r: Record) -> str:
    line = f"rollback from step {r['from_step']} to step {r['to_step']} ({r['source']}"
    if r.get("replay_steps"):
        line += f", {r['replay_steps']} steps trained again"
    return line + f"; rollback {r['rollbacks']} of the run)"


def _replay(r: Record) -> str:
    if r["verdict"] == "transient":
        rank = f" on rank {r['rank']}" if r.get("rank") is not None else ""
        return (
            f"replay of step {r['step']}: the {r['metric']} anomaly did not come back: a transient "
            f"fault{rank}, the replayed step applied ({r['seconds']:.2f} s)"
        )
    return f"replay of step {r['step']}: the {r['metric']} anomaly came back ({r['seconds']:.2f} s)"


def _profile(r: Record) -> str:
    first, last = r["steps"]
    extra = f", memory snapshot {r['memory_snapshot']}" if r.get("memory_snapshot") else ""
    return f"profile of steps {first}-{last} on rank {r['rank']}: {r['trace']}{extra}"


def _group_left(r: Record) -> str:
    group, step = r["group"], r["step"]
    if r["reason"] == "slow":
        return (
            f"replica group {group} leaves the job at step {step}: the straggler on "
            f"{r['timing_steps']} timing steps in a row"
        )
    if r.get("reported_by") == group:  # the late group itself
        return (
            f"this replica group ({group}) was late for step {step}'s quorum: the others trained "
            f"{r['missed_steps']} step(s) without it; it took a peer's state"
        )
    why = "its heartbeats stopped" if r["reason"] == "dead" else "alive but late"
    return (
        f"replica group {group} left out of step {step}'s quorum: {why} (the quorum came after "
        f"{r['waited_s']:.1f} s)"
    )


FORMATS: dict[str, Callable[[Record], str]] = {
    "checkpoint": _checkpoint,
    "resume": _resume,
    "anomaly": _anomaly,
    "rollback": _rollback,
    "replay": _replay,
    "profile": _profile,
    "checkpoint_invalid": lambda r: f"checkpoint {r['path']} skipped: {r['reason']}",
    "checkpoint_refused": lambda r: f"checkpoint at step {r['step']} refused: {r['reason']}",
    "skip_data": lambda r: (
        f"data skipped: samples {r['start']}-{r['end']} ({r['samples']} samples) are not read again"
    ),
    "lr_backoff": lambda r: (
        f"learning rate x{r['lr_scale']:.3g} and clipping x{r['clip_scale']:.3g}"
        + (f" until step {r['until_step']}" if r["until_step"] > 0 else " for the rest of the run")
    ),
    "lr_restore": lambda r: f"learning rate and clipping back to the schedule at step {r['step']}",
    "abort": lambda r: f"abort at step {r['step']}: {r['reason']}",
    "preempt": lambda r: f"preempted: {r['reason']}; checkpointed at step {r['checkpoint_step']}",
    "straggler": lambda r: (
        f"straggler at step {r['step']}: replica group {r['group']}'s {r['part']} (data and "
        f"forward+backward) took {r['seconds']:.3g} s, {r['ratio']:.3g}x the other groups' median"
        if r.get("scope") == "group"
        else f"straggler at step {r['step']}: rank {r['rank']}'s {r['part']} took "
        f"{r['seconds']:.3g} s, {r['ratio']:.3g}x the other ranks' median"
    ),
    "group_left": _group_left,
    "hang": lambda r: (
        f"hang: rank {r['rank']} ended no step for {r['waited_s']:.0f} s; stacks in {r['stacks']}"
    ),
    "host_excluded": lambda r: (
        f"excluded host {r['host']} (rank {r['rank']}): {r['transients']} transient faults"
    ),
    "source_exhausted": lambda r: (
        f"data source {r['source']} used up at sample {r['position']} ({r['samples']} samples, "
        f"{_shown(r['epochs'])} epochs)"
    ),
}


def event_line(record: Record) -> str | None:
    """The console's line for an event, or None for an event the console leaves to the files."""
    fmt = FORMATS.get(record["kind"])
    return fmt(record) if fmt is not None else None


def eta(elapsed_s: float, steps_run: int, steps_left: int) -> float | None:
    """Seconds to the last step at the rate of the steps this process ran in `elapsed_s`: not
    the step number it reached, since a resumed process, or a replica group that took a peer's
    state at step 29, reached it mostly without running those steps. None before a step ran."""
    return elapsed_s / steps_run * max(steps_left, 0) if steps_run > 0 else None


def step_line(record: Record, max_steps: int, elapsed_s: float, eta_s: float | None = None) -> str:
    """A logged step: loss, validation loss, LR, throughput, MFU where known, elapsed, ETA."""
    parts = [f"step {record['step']}/{max_steps}", f"loss {record['loss']:.4f}"]
    if "val_loss" in record:
        parts.append(f"val {record['val_loss']:.4f}")
    parts += [f"lr {record['lr']:.2e}", f"{record['tokens_per_s']:,.0f} tok/s"]
    if "mfu" in record:
        parts.append(f"mfu {record['mfu']:.1%}")
    parts.append(f"{duration(elapsed_s)} elapsed")
    if eta_s is not None:
        parts.append(f"eta {duration(eta_s)}")
    return "  ".join(parts)
