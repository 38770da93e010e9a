"""Goodput at cluster scale: a seeded Monte Carlo discrete-event simulation of a long run.

Time is wall-clock seconds; *work* is seconds of productive step time. Failures arrive as one
Poisson process per kind at the job's rate (per-GPU rate x GPUs), in wall time, whatever the job
is doing. Between failures the run follows a fixed schedule from the start of its segment:
`interval` seconds of work (slowed by the snapshot copies, a fraction `snapshot_overhead` of the
work), then a checkpoint whose blocking part (`stall_s`) stops training; an asynchronous
checkpoint commits `write_s` after its stall (a synchronous one at the stall's end). What a
failure costs depends on its kind and on whether bigtrain heals in place:

| kind | healing (bigtrain) | plain checkpoint/restart |
| --- | --- | --- |
| hardware | restart: `restart_s + load_s`; work since the last commit is lost | the same |
| numeric (NaN, spike) | roll back in place to the newest good snapshot (`snapshot_every` x step, confirmed `confirm_steps` later): restore + the replayed step, then a checkpoint at once | crash, restart |
| transient | one replayed step | crash, restart |
| hang | the watchdog's timeout, then restart | the collective timeout, then restart |
| preemption | a synchronous save, then restart: nothing lost | the same |

With fault-tolerant replica groups (`groups` > 1, torchft; healing on) a hardware failure kills
only its group, one of `groups` drawn at random: the group is away `group_restart_s` (its restart
and the state fetched from a live peer) while the others train at (groups - 1) / groups of the
job's throughput, after a stall of `survivor_stall_s` (the heartbeat timeout and the failed,
uncommitted step). Nothing since the last checkpoint is lost: the peers hold it. Both costs are
paused work charged at the failure (the capacity lost while the group is away is its time over
`groups`), as a replay's step is. A failure of a group already away starts its restart again; one
that leaves no group alive restarts the whole job. The other kinds keep their whole-job costs: a
NaN or a corruption reaches every group through the averaged gradient (no clean peer), a hang
cannot be told from a slow collective before the watchdog, and a planned interruption is of the
whole job. A whole-job restart brings every group back at once (the time away already charged
beyond it stays charged: conservative, and rare).

A failure while the job restarts starts the restart again (Daly's model; with replica groups too,
conservatively: a group could be left to rejoin later); numeric and transient faults need a
training job and are ignored then. Every trial of every candidate interval sees the same failure
stream (common random numbers), so goodput differences between intervals carry little noise. The
whole state is numpy arrays of shape (intervals, trials): one Python iteration per failure, each
vectorised over both.

Closed forms (Young 1974; Daly 2006, FGCS 22:303) for exponential failures with mean M, a blocking
checkpoint cost C and restart R: Young's interval sqrt(2 C M); Daly's sqrt(2 C M) [1 + 1/3
sqrt(C / 2M) + 1/9 (C / 2M)] - C for C < 2M (else M); Daly's expected wall time per interval of
work T is M e^(R/M) (e^((T + C)/M) - 1), so goodput T / that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

KINDS = ("hardware", "numeric", "transient", "hang", "preemption")
CAUSES = (
    "checkpoint_stall",
    "snapshots",
    "suspicions",
    "lost_work",
    "restart",
    "hang_detection",
    "rollback",
    "replay",
    "preemption_save",
    "group_restart",
    "survivor_stall",
)
_CAUSE = {name: i for i, name in enumerate(CAUSES)}


@dataclass(frozen=True)
class SimParams:
    """What the simulation needs, in seconds (work or wall) and failures per second of the job."""

    horizon_s: float
    rates: dict[str, float]
    """Failures per wall second of the whole job, by kind (KINDS)."""
    step_s: float
    stall_s: float
    """Blocking part of one checkpoint (the whole write when synchronous)."""
    write_s: float
    """Background write of an asynchronous checkpoint, after its stall."""
    async_save: bool
    restart_s: float
    """Relaunch to the first step, checkpoint load included."""
    hang_timeout_s: float
    plain_hang_timeout_s: float
    snapshot_overhead: float
    """Snapshot copies' seconds per second of work (healing only)."""
    snapshot_work_s: float
    """Work between snapshots (0: no snapshots; a rollback reads the last checkpoint)."""
    confirm_work_s: float
    restore_s: float
    """In-place rollback: putting the snapshot back (from disk without snapshots: the load)."""
    replay_s: float
    """One replayed step."""
    save_s: float
    """A preemption's synchronous save."""
    groups: int = 1
    """Fault-tolerant replica groups (torchft); 1: a hardware failure restarts the whole job."""
    group_restart_s: float = 0.0
    """A group's absence after its hardware failure: its restart and the state from a peer."""
    survivor_stall_s: float = 0.0
    """What a group's failure stops the other groups for: the heartbeat timeout and the step."""
    suspicion_overhead: float = 0.0
    """Replays of suspicious healthy steps, seconds per second of work (healing only)."""


@dataclass
class Outcome:
    """Per interval and trial: goodput and wall seconds by cause (CAUSES), shape (I, N)."""

    intervals: np.ndarray
    goodput: np.ndarray
    lost: np.ndarray = field(repr=False)
    """(len(CAUSES), I, N) wall seconds."""
    horizon_s: float

    def mean(self) -> np.ndarray:
        return self.goodput.mean(axis=1)

    def lost_fractions(self, i: int) -> dict[str, float]:
        return {c: float(self.lost[k, i].mean() / self.horizon_s) for c, k in _CAUSE.items()}


def failure_stream(
    rates: dict[str, float], horizon_s: float, trials: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """(times, kinds), each (trials, K): failure times (inf past the horizon) and kind indices."""
    total = sum(rates.values())
    if total <= 0:
        return np.full((trials, 1), np.inf), np.zeros((trials, 1), dtype=int)
    rng = np.random.default_rng(seed)
    expected = total * horizon_s
    k = int(expected + 8 * math.sqrt(expected) + 20)
    times = np.cumsum(rng.exponential(1 / total, size=(trials, k)), axis=1)
    while times[:, -1].min() < horizon_s:  # practically never: extend the streams
        more = np.cumsum(rng.exponential(1 / total, size=(trials, k)), axis=1)
        times = np.concatenate([times, times[:, -1:] + more], axis=1)
    p = np.array([rates.get(kind, 0.0) for kind in KINDS]) / total
    kinds = rng.choice(len(KINDS), size=times.shape, p=p)
    times[times >= horizon_s] = np.inf
    last = int((times < np.inf).sum(axis=1).max())
    return times[:, : max(last, 1)], kinds[:, : max(last, 1)]


class _Schedule:
    """Where a segment's schedule stands `x` seconds (wall, dead time excluded) after its start:
    an optional leading checkpoint (`lead`: its stall), then cycles of work and checkpoint."""

    def __init__(self, p: SimParams, intervals: np.ndarray, healing: bool) -> None:
        self.o_snap = p.snapshot_overhead if healing else 0.0
        self.o = self.o_snap + (p.suspicion_overhead if healing else 0.0)
        self.work = intervals[:, None]  # (I, 1) work per cycle
        self.work_wall = self.work * (1 + self.o)
        written = p.write_s if p.async_save else 0.0
        stall = p.stall_s  # sim_params: all of a synchronous save
        # An asynchronous write longer than the next interval holds up the next save.
        self.stall = np.maximum(stall, written - self.work_wall)
        self.written = written
        self.cycle = self.work_wall + self.stall

    def progress(self, x: np.ndarray, lead: np.ndarray) -> np.ndarray:
        xs = np.maximum(x - lead, 0.0)
        n = np.floor(xs / self.cycle)
        return n * self.work + np.minimum(xs - n * self.cycle, self.work_wall) / (1 + self.o)

    def committed(self, x, lead, p0, before) -> np.ndarray:
        """Work held by the newest committed checkpoint."""
        done = np.floor((x - lead - self.written) / self.cycle)
        base = np.where((lead <= 0) | (x >= lead + self.written), p0, before)
        return np.where(done >= 1, p0 + done * self.work, base)


def simulate(p: SimParams, intervals: np.ndarray, healing: bool, trials: int, seed: int) -> Outcome:
    """Goodput of each checkpoint interval (seconds of work between checkpoints) over `trials`
    runs of `p.horizon_s`."""
    intervals = np.asarray(intervals, dtype=float)
    times, kinds = failure_stream(p.rates, p.horizon_s, trials, seed)
    sched = _Schedule(p, intervals, healing)
    shape = (len(intervals), trials)
    s = {k: np.zeros(shape) for k in ("t0", "dead", "p0", "before", "lead", "dstart", "d1")}
    s["c1"] = np.zeros(shape, dtype=int)
    s["back"] = np.zeros((*shape, p.groups))  # wall time each replica group is back
    groups = group_stream(p.groups, times.shape, seed)
    lost = np.zeros((len(CAUSES), *shape))
    for k in range(times.shape[1]):
        te = np.broadcast_to(times[None, :, k], shape)
        if not np.isfinite(te).any():
            break
        kind, group = (np.broadcast_to(a[None, :, k], shape) for a in (kinds, groups))
        _event(p, sched, healing, s, lost, te, kind, group)
    end = np.full(shape, p.horizon_s)
    _close_dead(s, lost, end)
    x = end - s["t0"] - s["dead"]
    work = sched.progress(x, s["lead"])
    # Training (x < 0 only where a pause charged at a failure runs past the horizon: the stall
    # term gives its overhang back, as at a restart).
    running = s["t0"] <= end
    lost[_CAUSE["checkpoint_stall"]] += np.where(running, x - work * (1 + sched.o), 0.0)
    lost[_CAUSE["snapshots"]] += work * sched.o_snap
    lost[_CAUSE["suspicions"]] += work * (sched.o - sched.o_snap)
    useful = s["p0"] + work
    return Outcome(intervals, useful / p.horizon_s, lost, p.horizon_s)


def _close_dead(s: dict, lost: np.ndarray, at: np.ndarray) -> None:
    """Charge the dead time (restart, detection, restore) from its start up to `at`: its first
    part to its own cause, the rest to the restart."""
    elapsed = np.maximum(np.minimum(at, s["t0"]) - s["dstart"], 0.0)
    first = np.minimum(elapsed, s["d1"])
    for code in _CAUSE.values():
        lost[code] += np.where(s["c1"] == code, first, 0.0)
    lost[_CAUSE["restart"]] += elapsed - first


def group_stream(groups: int, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Which replica group each failure hits, uniformly: (trials, K), the same for every interval
    (common random numbers), from a stream apart from the failures' own."""
    return np.random.default_rng([seed, 1]).integers(groups, size=shape)


def _event(p, sched, healing, s, lost, te, kind, group) -> None:
    """One failure per (interval, trial), at wall time `te` (inf: none), on replica `group`."""
    live = np.isfinite(te)
    te = np.where(live, te, s["t0"])  # no failure: nothing below changes (every update is masked)
    dead = te < s["t0"]
    x = te - s["t0"] - s["dead"]
    work = np.where(dead, 0.0, sched.progress(x, s["lead"]))
    now = s["p0"] + work
    kept = sched.committed(x, s["lead"], s["p0"], s["before"])
    numeric, flaky = kind == KINDS.index("numeric"), kind == KINDS.index("transient")
    inplace, transient = healing & numeric, healing & flaky
    # Numeric and transient faults need a training job, in either mode: nothing happens while it
    # restarts (plain checkpoint/restart crashes on them only while it trains).
    alone = _group_failure(p, s, lost, te, live & ~dead & (kind == KINDS.index("hardware")), group)
    restart = live & ~(inplace | transient | alone) & ~((numeric | flaky) & dead)
    rollback = live & inplace & ~dead
    replay = live & transient & ~dead
    s["dead"] += np.where(replay, p.replay_s, 0.0)
    lost[_CAUSE["replay"]] += np.where(replay, p.replay_s, 0.0)
    closing = restart | rollback
    # The closing segment: its stalls and snapshot copies, then its dead time up to now.
    running = closing & ~dead
    lost[_CAUSE["checkpoint_stall"]] += np.where(running, x - work * (1 + sched.o), 0.0)
    lost[_CAUSE["snapshots"]] += np.where(running, work * sched.o_snap, 0.0)
    lost[_CAUSE["suspicions"]] += np.where(running, work * (sched.o - sched.o_snap), 0.0)
    _close_dead_where(s, lost, te, closing)
    target = _rollback_target(p, now, s["p0"], kept)
    preempted = restart & ~dead & (kind == KINDS.index("preemption"))
    new_p0 = np.where(rollback, target, np.where(preempted, now, kept))
    lost[_CAUSE["lost_work"]] += np.where(closing, now - new_p0, 0.0)
    hang = restart & ~dead & (kind == KINDS.index("hang"))
    timeout = p.hang_timeout_s if healing else p.plain_hang_timeout_s
    d1 = np.select([rollback, hang, preempted], [p.restore_s + p.replay_s, timeout, p.save_s], 0.0)
    c1 = np.select(
        [rollback, hang, preempted],
        [_CAUSE["rollback"], _CAUSE["hang_detection"], _CAUSE["preemption_save"]],
        _CAUSE["restart"],
    )
    d2 = np.where(rollback, 0.0, p.restart_s)
    for key, value in (
        ("before", np.where(rollback, np.minimum(kept, target), new_p0)),
        ("p0", new_p0),
        ("lead", np.where(rollback, sched.stall, 0.0)),
        ("dstart", te),
        ("d1", d1),
        ("c1", c1),
        ("t0", te + d1 + d2),
        ("dead", 0.0),
    ):
        s[key] = np.where(closing, value, s[key])
    s["back"] = np.where(closing[..., None], 0.0, s["back"])  # the groups restart with the job


def _group_failure(p, s, lost, te, hardware, group) -> np.ndarray:
    """Where a hardware failure of a training job costs only its replica group (p.groups > 1):
    the group is away `group_restart_s` from `te` (from `te` again if it was away); the others
    stall unless it was away already. The last live group's failure restarts the whole job."""
    if p.groups == 1:
        return np.zeros_like(hardware)
    back = s["back"]
    old = np.take_along_axis(back, group[..., None], axis=-1)[..., 0]
    was_up = old <= te
    alone = hardware & ~(was_up & ((back <= te[..., None]).sum(axis=-1) == 1))
    until = te + p.group_restart_s
    # Paused work charged now (as a replay's), never past the horizon: the group's time away over
    # `groups` (the others train at (groups - 1) / groups meanwhile), and the survivors' stall.
    away = np.clip(np.minimum(until, p.horizon_s) - np.maximum(old, te), 0.0, None) / p.groups
    stall = np.where(was_up, np.minimum(p.survivor_stall_s, p.horizon_s - te), 0.0)
    lost[_CAUSE["group_restart"]] += np.where(alone, away, 0.0)
    lost[_CAUSE["survivor_stall"]] += np.where(alone, stall, 0.0)
    s["dead"] += np.where(alone, away + stall, 0.0)
    hit = alone[..., None] & (np.arange(p.groups) == group[..., None])
    s["back"] = np.where(hit, until[..., None], back)
    return alone


def _close_dead_where(s: dict, lost: np.ndarray, te: np.ndarray, mask: np.ndarray) -> None:
    part = np.zeros_like(lost)
    _close_dead(s, part, np.where(mask, te, s["dstart"]))
    lost += part


def _rollback_target(p: SimParams, now, p0, kept) -> np.ndarray:
    """The newest good target: the newest snapshot confirmed by `confirm_work_s` of healthy work,
    or the segment's start (good by definition); the last checkpoint without snapshots."""
    if p.snapshot_work_s <= 0:
        return kept
    confirmed = np.floor((now - p.confirm_work_s) / p.snapshot_work_s) * p.snapshot_work_s
    return np.where(now - p.confirm_work_s >= p0, np.maximum(p0, confirmed), p0)


# --- closed forms ---------------------------------------------------------------------------


def young_interval(cost_s: float, mtbf_s: float) -> float:
    return math.sqrt(2 * cost_s * mtbf_s)


def daly_interval(cost_s: float, mtbf_s: float) -> float:
    if cost_s >= 2 * mtbf_s:
        return mtbf_s
    r = cost_s / (2 * mtbf_s)
    return math.sqrt(2 * cost_s * mtbf_s) * (1 + math.sqrt(r) / 3 + r / 9) - cost_s


def daly_goodput(interval_s: float, cost_s: float, restart_s: float, mtbf_s: float) -> float:
    """Work / expected wall time under Daly's complete model (failures also during checkpoints
    and restarts)."""
    wall = mtbf_s * math.exp(restart_s / mtbf_s) * math.expm1((interval_s + cost_s) / mtbf_s)
    return interval_s / wall


def best_interval(intervals: np.ndarray, goodput: np.ndarray) -> float:
    """The interval of highest mean goodput: a parabola in log(interval) through the points
    around the best grid point (goodput is flat near its top; the fit averages out the noise).
    """
    i = int(np.argmax(goodput))
    lo, hi = max(0, i - 4), min(len(intervals), i + 5)
    if hi - lo < 3:
        return float(intervals[i])
    x = np.log(intervals[lo:hi])
    a, b, _ = np.polyfit(x, goodput[lo:hi], 2)
    if a >= 0:
        return float(intervals[i])
    vertex = float(np.clip(-b / (2 * a), x[0], x[-1]))
    return math.exp(vertex)
