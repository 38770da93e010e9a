"""What failures and their insurance cost this process, measured: events and final.json's `costs`.

- `startup` (after the first step): seconds from process start to the first step by phase
  (utils/clock.py STARTUP_PHASES, then `first_step_s`, of which `step_1_s` is the step itself), the restart gap since the previous
  process of the run directory wrote its last event, and the launcher's restart counts.
- `recovered` (after the first step that follows a rollback): `restore_s` (anomaly to the restored
  state: the rollback's own work), `seconds` (anomaly to the end of the first resumed step),
  `steps_lost` (steps between the target and the anomaly, done again), `source`.
- `costs` (when the process ends: finish, stop, give-up, preemption): the totals. final.json holds
  the same under `costs`.

Checkpoints (`checkpoint_started`, `checkpoint`: stall, write time, bytes per rank) and replays
(`replay` and `suspicion`: seconds) are written where they happen; this callback only adds them up. What only a
dead process could tell (a hang's detection, `hang`: `waited_s`) is in its own event.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from typing import Any

from bigtrain.train.hooks import Callback
from bigtrain.train.step import StepResult
from bigtrain.utils.clock import StartupClock, Tally

RECENT = 1000  # steps whose median stands for a step's time (bounded: a run has millions)


class CostLedger(Callback):
    def __init__(self, clock: StartupClock) -> None:
        self.clock = clock
        self.startup: dict[str, Any] | None = None
        self.steps = Tally()  # every step's time
        self.recent: deque[float] = deque(maxlen=RECENT)  # the last steps', for their median
        self.replays = Tally()
        self.stalls = Tally()
        self.writes = Tally()
        self.rollbacks: list[dict[str, Any]] = []
        self.anomaly_time: float | None = None
        self.pending: dict[str, Any] | None = None  # a rollback whose first step is due
        self.reported = False

    def on_step_end(self, trainer, result: StepResult) -> None:
        now = time.time()
        self.steps.add(result.step_time)
        self.recent.append(result.step_time)
        if self.startup is None:
            self.startup = self.clock.record(now) | {"step_1_s": round(result.step_time, 4)}
            trainer.event("startup", **self.startup)
        if self.pending is not None and not result.rolled_back:
            pending, self.pending = self.pending, None
            pending["seconds"] = round(now - pending.pop("anomaly_time"), 4)
            self.rollbacks.append(pending)
            trainer.event("recovered", **pending)
        if result.preempt:
            self._report(trainer)

    def on_event(self, trainer, record: dict[str, Any]) -> None:
        kind = record["kind"]
        if kind == "anomaly":
            self.anomaly_time = record["time"]
        elif kind == "rollback" and self.anomaly_time is not None:
            if self.pending is not None:  # rolled back again before a step resumed: kept
                self.pending["seconds"] = round(
                    record["time"] - self.pending.pop("anomaly_time"), 4
                )
                self.rollbacks.append(self.pending)
            self.pending = {
                "from_step": record["from_step"],
                "to_step": record["to_step"],
                "source": record["source"],
                "steps_lost": record["from_step"] - record["to_step"],
                "restore_s": round(record["time"] - self.anomaly_time, 4),
                "anomaly_time": self.anomaly_time,
            }
            self.anomaly_time = None  # an anomaly that is only skipped must not date a later one
        elif kind in ("replay", "suspicion"):  # an anomaly's replay, or a suspicion's
            self.replays.add(record.get("seconds", 0.0))
        elif kind == "checkpoint_started":  # an asynchronous save's stall
            self.stalls.add(record["stall_s"])
        elif kind == "checkpoint":  # a synchronous save stalled for all of it
            if not record["async"]:
                self.stalls.add(record["stall_s"])
            self.writes.add(record["write_s"], max(record["bytes_per_rank"]))

    def on_finish(self, trainer) -> None:
        self._report(trainer)

    def on_stop(self, trainer, reason: str) -> None:
        self._report(trainer)

    def summary(self, trainer) -> dict[str, Any]:
        """The totals of this process (final.json's `costs`)."""
        recent = self.recent
        return {
            "wall_s": round(time.time() - self.clock.started, 3),
            "startup": self.startup or {},
            "steps": self.steps.count,
            "step_s_total": round(self.steps.seconds, 3),
            "median_step_s": round(statistics.median(recent), 5) if recent else None,
            "checkpoint_stall": self.stalls.to_dict(),
            "checkpoint_write": self.writes.to_dict(),
            "snapshots": trainer.healer.snapshots.to_dict(),
            "replays": self.replays.to_dict(),
            "rollbacks": self.rollbacks,
            "world_size": trainer.env.world_size,
        }

    def _report(self, trainer) -> None:
        if not self.reported:
            self.reported = True
            trainer.event("costs", **self.summary(trainer))
