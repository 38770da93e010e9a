"""Replay: run an anomalous step's micro-batches once more, to tell bad hardware from bad data.

The monitor decides before the optimizer step, so when it finds a non-finite value or a spike the
weights and optimizer states are still those the step started from: a replay needs only the step's
micro-batches (still in hand) and its RNG state (taken before its forward). Every rank discards its
gradients, restores the RNG and runs forward and backward again, deterministically; fault drills
that model bad data fire again, `drill.transient_nan_step` does not.

- The anomaly comes back: `reproduced`. The step is handled as before (rollback, skip window, LR
  back-off, per monitor.nonfinite / on_spike).
- The second run is clean: `transient`. The step goes on with the replayed gradients: nothing is
  skipped, the LR is not cut, and the weights end as if the fault never happened. The rank whose
  local statistics (per-tensor sums of squares, non-finite counts, its loss) moved between the two
  runs is named; after `resilience.max_transient_per_rank` transients on one host the run stops
  with exit 6 and the host's name in RUN_DIR/excluded_hosts.txt (requeue without it).

Every rank reaches the same verdict: the monitor's numbers are reduced over all ranks, and the
ranks' distances are gathered (one small collective, on replays only).
"""

from __future__ import annotations

import math
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from bigtrain.checkpoint.rng import rng_state, set_rng_state
from bigtrain.config.schema import ResilienceConfig
from bigtrain.errors import HostExcluded
from bigtrain.monitor.monitor import GradMonitor, Health
from bigtrain.parallel.backends.base import Backend
from bigtrain.resilience.detect import Anomaly, Verdict
from bigtrain.state.events import Events
from bigtrain.state.run import Counters
from bigtrain.store.rundir import RunDir
from bigtrain.utils.dist import all_gather_objects

MOVED = 1e-3  # a rank whose local statistics moved by more than this (relative) differed
NOISE = 1e-6
"""A tensor's sum of squares is compared relative to at least this share of the rank's total:
a gradient that is rounding noise (attention's key bias, whose exact gradient is 0) may differ
between two runs of a kernel with atomics (CUDA) by more than MOVED of itself, never by this
much of the whole; a corruption that matters moves far more."""


def local_distance(first: torch.Tensor, second: torch.Tensor, tensors: int = 0) -> float:
    """How far a rank's local statistics moved between two runs of a step: the largest relative
    change; inf where a value turned non-finite or finite. The first `tensors` values are sums
    of squares, each relative to at least NOISE of their total."""
    a, b = first.double(), second.double()
    finite = torch.isfinite(a)
    if not torch.equal(finite, torch.isfinite(b)):
        return math.inf
    scale = a.abs()
    if tensors:
        total = a[:tensors].masked_fill(~finite[:tensors], 0.0).sum()
        scale[:tensors] = scale[:tensors].clamp_min(NOISE * total)
    change = ((a - b).abs() / scale.clamp_min(1e-30)).masked_fill(~finite, 0.0)
    return float(change.max()) if change.numel() else 0.0  # host sync: replays only


@dataclass
class ReplayReport:
    """Where a replay's verdict goes: its events, the transient-fault counts by host (counters),
    and the run directory (excluded_hosts.txt)."""

    events: Events
    counters: Counters
    run_dir: RunDir


class Replay:
    def __init__(self, cfg: ResilienceConfig) -> None:
        self.cfg = cfg
        self.hosts: list[str] | None = None  # every rank's hostname, gathered at the first replay

    def before_step(self) -> dict[str, Any] | None:
        """The RNG state a replay restores (host copies of the generators' states: cheap)."""
        return rng_state() if self.cfg.replay else None

    def wanted(self, verdict: Verdict) -> bool:
        """A step the ladder would act on (a warned spike is applied anyway)."""
        return self.cfg.replay and verdict.anomaly is not None and not verdict.warn_only

    def run(
        self,
        backend: Backend,
        monitor: GradMonitor,
        rng: dict[str, Any] | None,
        execute: Callable[[], tuple[Any, Health]],
    ) -> tuple[Any, Health, list]:
        """Run the step again (`execute`: its micro-batches once more): the second run's
        (StepResult, Health), and the ranks whose local statistics moved between the two runs,
        most first."""
        first_local = monitor.last_local
        assert first_local is not None and rng is not None, "a replay follows a monitored step"
        backend.skip_step()  # the first run's gradients go
        set_rng_state(rng)
        result, health = execute()
        tensors = len(monitor.names)
        distances = all_gather_objects(local_distance(first_local, monitor.last_local, tensors))
        moved = sorted(
            (r for r, d in enumerate(distances) if d > MOVED), key=lambda r: -distances[r]
        )
        return result, health, moved

    def report(
        self,
        to: ReplayReport,
        first: Anomaly,
        second: Anomaly | None,
        moved: list[int],
        seconds: float = 0.0,
    ) -> None:
        """The `replay` event (with the replay's `seconds`); a transient fault counts against the host of the rank that moved
        most (exit 6 after resilience.max_transient_per_rank on one host)."""
        rank = moved[0] if moved else None
        to.events.event(
            "replay",
            verdict="reproduced" if second is not None else "transient",
            rank=rank,
            ranks=sorted(moved),
            metric=first.metric,
            first=first.value,
            second=second.value if second is not None else None,
            seconds=round(seconds, 4),
        )
        if second is None and rank is not None:
            self._count(to, rank)

    def report_suspicion(
        self,
        to: ReplayReport,
        suspects: list[list],
        moved: list[int],
        seconds: float,
        checksums: list[list] | None = None,
        again: list[list] | None = None,
    ) -> None:
        """The `suspicion` event of a replayed suspicious step: `transient` when some rank's
        local statistics moved (silent data corruption: the replayed step goes on, the host is
        counted as for any transient fault), else `reproduced` (the data's: the step goes on,
        and the rules judged the replay as any step). `checksums`: [name, residual] of the
        tensors whose gradient checksums mismatched (monitor/checksums.py); `again`: those the
        replay mismatched too."""
        rank = moved[0] if moved else None
        extra = {}
        if checksums:
            extra = {"checksums": checksums[:5], "checksums_again": (again or [])[:5]}
        to.events.event(
            "suspicion",
            verdict="transient" if moved else "reproduced",
            rank=rank,
            ranks=sorted(moved),
            tensors=suspects[:5],
            seconds=round(seconds, 4),
            **extra,
        )
        if rank is not None:
            self._count(to, rank)

    def _count(self, to: ReplayReport, rank: int) -> None:
        if self.hosts is None:
            self.hosts = all_gather_objects(socket.gethostname())
        host = self.hosts[rank]
        counts = to.counters.transients
        counts[host] = counts.get(host, 0) + 1
        if counts[host] < self.cfg.max_transient_per_rank:
            return
        if to.run_dir.is_main:
            path = to.run_dir.path / "excluded_hosts.txt"
            known = path.read_text().split() if path.is_file() else []
            if host not in known:
                with open(path, "a") as f:
                    f.write(host + "\n")
        reason = (
            f"{counts[host]} transient faults on host {host} (rank {rank}) by step "
            f"{to.counters.step + 1} (resilience.max_transient_per_rank="
            f"{self.cfg.max_transient_per_rank})"
        )
        to.events.event("host_excluded", host=host, rank=rank, transients=counts[host])
        raise HostExcluded(
            f"{reason}; its name is in excluded_hosts.txt, exit 6: requeue without it"
        )
