"""What a run directory's events say failures cost: the report's time-lost table, and the costs
`bigtrain plan --goodput --from RUN_DIR` takes instead of its defaults.

Each process of a run writes a `startup` event after its first step and a `costs` event when it
ends (callbacks/cost_ledger.py); a process killed (a crash, a hang, SIGKILL) writes no `costs`: its
wall time runs to its last event, and its steps past the checkpoint the next process resumed from
count as work lost to the restart.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bigtrain.errors import ConfigError
from bigtrain.store.rundir import read_jsonl

GB = 1e9
SMALL_BYTES = 100e6  # per rank: below it a checkpoint's time measures overhead, not bandwidth
LOSSES = (
    ("startup", "process start to the first step"),
    ("restart_gap", "between a process's last event and the next one's start"),
    ("checkpoint_stall", "training waiting for checkpoints"),
    ("snapshots", "in-memory snapshots for rollbacks"),
    ("replays", "replayed steps (anomalies' and suspicions')"),
    ("rollback_restore", "rollbacks putting the good state back"),
    ("rollback_redone", "steps done again after rollbacks"),
    ("restart_redone", "steps done again after restarts"),
    ("hang_detection", "waiting for the hang watchdog"),
    ("other", "evaluation, logging, samples, the rest"),
)


@dataclass
class Process:
    """One process's events (from its `start` to the next one's)."""

    events: list[dict[str, Any]]

    def first(self, kind: str) -> dict[str, Any] | None:
        return next((e for e in self.events if e["kind"] == kind), None)

    def all(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["kind"] == kind]


def processes(events: list[dict[str, Any]]) -> list[Process]:
    out: list[Process] = []
    for event in events:
        if event["kind"] == "start" or not out:
            out.append(Process([]))
        out[-1].events.append(event)
    return out


def time_lost(events: list[dict[str, Any]]) -> dict[str, float] | None:
    """Seconds of the run by where they went: `wall`, `productive` (steps kept) and LOSSES;
    None for a run without `startup` events (written by an older bigtrain)."""
    procs = processes(events)
    if not any(p.first("startup") for p in procs):
        return None
    rows = dict.fromkeys(["wall", "productive", *(name for name, _ in LOSSES)], 0.0)
    step_s = median_step_s(events) or 0.0
    for n, proc in enumerate(procs):
        startup, costs = proc.first("startup"), proc.first("costs")
        if startup is None:
            continue
        started = startup["time"] - startup["total_s"]
        rows["startup"] += startup["total_s"] - startup.get("step_1_s", 0.0)  # the step: below
        rows["restart_gap"] += startup.get("restart_gap_s", 0.0)
        rows["wall"] += startup.get("restart_gap_s", 0.0)
        hangs = {e["step"]: e["waited_s"] for e in proc.all("hang")}
        rows["hang_detection"] += sum(hangs.values())
        if costs is None:  # killed: to its last event; its steps past the next resume are lost
            rows["wall"] += proc.events[-1]["time"] - started
            steps = max(e["step"] for e in proc.events) - startup["step"] + 1
            redone = _redone_after(proc, procs[n + 1] if n + 1 < len(procs) else None)
            rows["restart_redone"] += redone * step_s
            rows["productive"] += max(0, steps - redone) * step_s
            continue
        rows["wall"] += costs["wall_s"]
        rows["checkpoint_stall"] += costs["checkpoint_stall"]["seconds"]
        rows["snapshots"] += costs["snapshots"]["seconds"]
        rows["replays"] += costs["replays"]["seconds"]
        redone = sum(r["steps_lost"] for r in costs["rollbacks"]) * (costs["median_step_s"] or 0)
        rows["rollback_restore"] += sum(r["restore_s"] for r in costs["rollbacks"])
        rows["rollback_redone"] += redone
        rows["productive"] += costs["step_s_total"] - redone - costs["replays"]["seconds"]
    rows["other"] = max(0.0, rows["wall"] - sum(v for k, v in rows.items() if k != "wall"))
    return rows


def _redone_after(proc: Process, after: Process | None) -> int:
    """Steps of a killed process past the checkpoint the next process resumed from."""
    resume = after.first("resume") if after else None
    if resume is None:
        return 0
    resumed = int(Path(resume["path"]).name.rsplit("_", 1)[-1])
    return max(0, max(e["step"] for e in proc.events) - resumed)


def median_step_s(events: list[dict[str, Any]]) -> float | None:
    steps = [e["median_step_s"] for e in events if e["kind"] == "costs" and e["median_step_s"]]
    return statistics.median(steps) if steps else None


def time_lost_table(rows: dict[str, float]) -> list[tuple[str, float, float, str]]:
    """(name, seconds, fraction of wall, what it is), productive first."""
    wall = rows["wall"] or 1.0
    out = [("productive", rows["productive"], rows["productive"] / wall, "steps the run kept")]
    out += [(name, rows[name], rows[name] / wall, text) for name, text in LOSSES]
    return out


# --- measured inputs for the goodput plan ---------------------------------------------------


def measured_costs(run_dir: Path) -> dict[str, tuple[float, str]]:
    """Goodput inputs measured in a run directory: {key: (value, how)}. ConfigError naming the
    file when it lacks what every measurement needs (a `startup` event and a checkpoint)."""
    path = run_dir / "events.jsonl"
    events = read_jsonl(path)
    checkpoints = [e for e in events if e["kind"] == "checkpoint" and "bytes_per_rank" in e]
    startups = [e for e in events if e["kind"] == "startup"]
    if not events or not startups or not checkpoints:
        missing = "events" if not events else "'startup'" if not startups else "'checkpoint'"
        raise ConfigError(
            f"--from: '{path}' has no {missing} events with measured costs (a run of this "
            "bigtrain with at least one committed checkpoint writes them)"
        )
    per_node = startups[0].get("local_world_size") or _world_size(events)
    small = statistics.median(max(c["bytes_per_rank"]) for c in checkpoints) < SMALL_BYTES
    out = _checkpoint_costs(checkpoints, per_node, small)
    out.update(_from_costs(events, checkpoints, per_node))
    if small:  # fixed costs dominate small copies: their bandwidths would mislead
        for key in ("snapshot_gbps", "restore_gbps", "load_gbps_per_node"):
            out.pop(key, None)
    return out


def _checkpoint_costs(checkpoints, per_node: int, small: bool) -> dict[str, tuple[float, str]]:
    """Bandwidths of large checkpoints; the fixed seconds of small ones (under SMALL_BYTES per
    rank, the time does not grow with the bytes: it measures the per-save overhead)."""
    asynchronous = [c for c in checkpoints if 0 < c["stall_s"] < c["write_s"]]
    if small:
        out = {"write_fixed_s": _seconds([c["write_s"] for c in checkpoints], "checkpoint writes")}
        if asynchronous:
            stalls = [c["stall_s"] for c in asynchronous]
            out["stall_fixed_s"] = _seconds(stalls, "asynchronous checkpoint stalls")
        return out
    rates = [sum(c["bytes_per_rank"][:per_node]) / c["write_s"] for c in checkpoints]
    out = {"save_gbps_per_node": _median(rates, "checkpoint writes", per_node)}
    if asynchronous:
        stalls = [c["bytes_per_rank"][0] / c["stall_s"] for c in asynchronous]
        out["stall_gbps"] = _median(stalls, "asynchronous checkpoint stalls")
    return out


def _seconds(values: list[float], what: str) -> tuple[float, str]:
    how = f"measured: median of {len(values)} {what} (small checkpoints: a fixed cost)"
    return statistics.median(values), how


def _median(rates: list[float], what: str, per_node: int | None = None) -> tuple[float, str]:
    node = f", {per_node} ranks per node" if per_node else ""
    return statistics.median(rates) / GB, f"measured: median of {len(rates)} {what}{node}"


def _world_size(events: list[dict[str, Any]]) -> int:
    start = next((e for e in events if e["kind"] == "start"), {})
    return int(start.get("world_size", 1))


def _from_costs(events, checkpoints, per_node: int) -> dict[str, tuple[float, str]]:
    out: dict[str, tuple[float, str]] = {}
    costs = [e for e in events if e["kind"] == "costs"]
    snaps = [c["snapshots"] for c in costs if c["snapshots"]["count"] and c["snapshots"]["mean_s"]]
    if snaps:
        out["snapshot_gbps"] = _median(
            [s["bytes_each"] / s["mean_s"] for s in snaps], "processes' snapshot copies"
        )
        held = statistics.median(s["bytes_each"] for s in snaps)
        restores = [
            held / r["restore_s"]
            for c in costs
            for r in c["rollbacks"]
            if r["source"] == "memory" and r["restore_s"] > 0
        ]
        if restores:
            out["restore_gbps"] = _median(restores, "rollbacks from memory")
    step_s = median_step_s(events)
    replays = [c["replays"]["mean_s"] for c in costs if c["replays"]["count"]]
    if replays and step_s:
        out["replay_steps"] = (
            statistics.median(replays) / step_s,
            f"measured: replay {statistics.median(replays):.3g} s / step {step_s:.3g} s",
        )
    out.update(_restarts(events, checkpoints, per_node))
    hangs = [e["waited_s"] for e in events if e["kind"] == "hang"]
    if hangs:
        out["hang_timeout_s"] = (statistics.median(hangs), f"measured: {len(hangs)} hang events")
    return out


def _restarts(events, checkpoints, per_node: int) -> dict[str, tuple[float, str]]:
    """A resumed process: its load bandwidth (the resumed checkpoint's bytes over its load) and
    its restart cost (the gap since the previous process, and its startup less the load)."""
    sizes = {Path(c["path"]).name: sum(c["bytes_per_rank"][:per_node]) for c in checkpoints}
    loads, restarts = [], []
    for proc in processes(events):
        resume, startup = proc.first("resume"), proc.first("startup")
        if resume is None or startup is None:
            continue
        load_s = startup["checkpoint_load_s"]
        name = Path(resume["path"]).name
        if load_s > 0 and name in sizes:
            loads.append(sizes[name] / load_s)
        if "restart_gap_s" in startup:
            # up to the first step, which is training: not part of the restart
            first_step = startup.get("step_1_s", 0.0)
            restarts.append(startup["restart_gap_s"] + startup["total_s"] - load_s - first_step)
    out: dict[str, tuple[float, str]] = {}
    if loads:
        out["load_gbps_per_node"] = _median(loads, "checkpoint loads on resume", per_node)
    if restarts:
        out["restart_s"] = (
            statistics.median(restarts),
            f"measured: {len(restarts)} restarts (gap + startup, load and first step aside)",
        )
    return out
