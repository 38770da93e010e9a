"""The healer: the loop's one partner for what changes a run when a step goes wrong.

The loop calls it by name, in this order, every step (train/loop.py):
  before_step   the end of a back-off (`lr_restore`)
  judge         the verdict on the monitor's numbers (detect.py); on an anomaly, one replay of
                the step (replay.py): clean -> a transient fault, the replayed step goes on
  after_step    the decision: events, the action per monitor.nonfinite / on_spike, a rollback
                (targets.py, recover.py), confirmations and new targets on healthy steps
  end_step      after the callbacks: a new target's snapshot, a rebuild's arrival
The states and transitions are in bigtrain/resilience/__init__.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, NoReturn, Protocol, TypeVar

from bigtrain.checkpoint.manager import CheckpointManager
from bigtrain.config.resilience import MonitorConfig, ResilienceConfig
from bigtrain.errors import AbortRun
from bigtrain.model.gpt import GradientRoles
from bigtrain.monitor.monitor import GradMonitor, Health
from bigtrain.parallel.replicas.groups import NoReplicaGroups, ReplicaGroups
from bigtrain.precision.scaler import ScaleUpdate
from bigtrain.resilience.detect import Anomaly, Detector, Verdict
from bigtrain.resilience.recover import Recovery, origin_record
from bigtrain.resilience.replay import Replay, ReplayReport
from bigtrain.resilience.targets import HeldTargets, Target, Targets
from bigtrain.state.events import Events
from bigtrain.state.run import RunState
from bigtrain.store.rundir import RunDir
from bigtrain.utils.clock import Tally, nested_bytes


class StepOutcome(Protocol):
    """What the healer reads of a step's result and writes into it (the loop's StepResult,
    train/step.py, is one): the verdict's fields in, the decision out, before any callback runs."""

    anomaly: Anomaly | None
    overflow: bool
    skipped: bool
    scale_update: ScaleUpdate | None
    action: str | None  # written: rollback, skip, warn or abort
    rolled_back: bool  # written
    checkpoint_now: bool  # written: checkpoint the restored state at once


logger = logging.getLogger(__name__)

R = TypeVar("R")  # a step's result, handed through judge unchanged (a replay makes a new one)


def abort(run_dir: RunDir, events: Events, reason: str) -> NoReturn:
    """Stop with exit 3: the ABORTED marker (so a restarted run exits at once instead of looping
    under torchrun or SLURM), an `abort` event, AbortRun. Checkpoints stay as they are."""
    if run_dir.is_main:
        run_dir.aborted_marker.write_text(reason + "\n")
    events.event("abort", reason=reason)
    raise AbortRun(reason)


class Healer:
    def __init__(
        self,
        cfg: ResilienceConfig,
        monitor: MonitorConfig,
        checkpoint_every: int,
        max_steps: int,
        names: list[str],
        manager: CheckpointManager,
        start_weights: Callable[[], None] | None,
        roles: GradientRoles = GradientRoles(),
    ) -> None:
        """`cfg`: resilience.*; `monitor`: monitor.* (the rules and the actions); checkpoints
        every `checkpoint_every` steps are rollback targets too; a back-off never outlasts
        `max_steps`; `names`: the monitor's gradient names; `roles`: what the suspicion tier
        knows of them (model/gpt.py gradient_roles)."""
        r = cfg
        self.cfg, self.monitor_cfg, self.max_steps = r, monitor, max_steps
        self.detector = Detector(monitor, names, roles)
        self.replay = Replay(r)
        self.targets = Targets(r.snapshot_every, checkpoint_every, r.snapshots, r.confirm_steps)
        self.recovery = Recovery(manager, start_weights)
        self.manager = manager
        self.consecutive = 0  # anomalous steps in a row
        # (restored step, anomaly step) of the last rollback
        self.last: tuple[int, int] | None = None
        self.origin: dict[str, Any] | None = None  # the start's trainer state and RNG (recover.py)
        # a rebuild's target step, and what applies on reaching it (the back-off)
        self.arrival: dict[str, Any] | None = None
        self.health: Health | None = None  # the current step's numbers, from judge to after_step
        self.pending: Target | None = None  # a target of this step whose snapshot is still due
        self.snapshots = Tally()  # the snapshots' host copies: count, seconds, bytes (this rank)
        # What it acts on, given by the loop once the run is assembled (attach).
        self.run: RunState
        self.events: Events
        self.monitor: GradMonitor
        self.replicas: ReplicaGroups | NoReplicaGroups
        self.run_dir: RunDir

    def attach(
        self,
        run: RunState,
        events: Events,
        monitor: GradMonitor,
        replicas: ReplicaGroups | NoReplicaGroups,
        run_dir: RunDir,
    ) -> None:
        """The run it heals: its state (restored by rollbacks), where its events go, the monitor
        (a replay's local numbers, max |g| for a report), the replica groups (whether this group
        leads the checkpoints) and the run directory (the ABORTED marker, excluded hosts). The
        snapshots the targets hold travel with a rejoining group's state."""
        self.run, self.events, self.monitor = run, events, monitor
        self.replicas, self.run_dir = replicas, run_dir
        run.add_memory("held", HeldTargets(self.targets))

    # --- the loop's calls ---------------------------------------------------------------------

    def start(self, resumed: bool) -> None:
        """After setup, resume and the callbacks' on_start, before the first step: the start
        target (held in memory when snapshots are on), and on a fresh run what rebuilding it
        needs."""
        run = self.run
        if not resumed:
            self.origin = origin_record(run)
        elif self.origin is None and not self.targets.ring:
            # A checkpoint of an earlier bigtrain carries no targets: its state is the start.
            self.targets.start = Target(run.step, run.stream.cursor)
            self.targets.start.healthy_after = self.cfg.confirm_steps
        here = self.targets.at(run.step)
        if here is not None and self.targets.holds_snapshots:
            here.held = run.hold()

    def before_step(self) -> None:
        """Back to the scheduled LR and clipping once a rollback's cooldown has passed."""
        state = self.run.counters
        if state.backoff_until > 0 and state.step >= state.backoff_until:
            self.events.event("lr_restore", lr_scale=1.0, after=state.lr_scale)
            state.lr_scale, state.clip_scale, state.backoff_until = 1.0, 1.0, 0

    def judge(
        self, result: R, health: Health, rng: dict | None, rerun: Callable[[], tuple[R, Health]]
    ) -> tuple[R, Health, Verdict]:
        """The step's verdict; an anomaly the ladder would act on, or a suspicion (suspicion.py),
        is replayed once first (`rerun`: the step's micro-batches again)."""
        backend = self.run.backend
        loss_scaled = backend.loss_scale() is not None
        verdict = self.detector.verdict(health, loss_scaled)
        clean = verdict.anomaly is None and not verdict.overflow
        suspects = self.detector.suspects(health) if clean and self.cfg.replay else []
        mismatches = self.monitor.mismatches(health) if clean and self.cfg.replay else []
        if self.replay.wanted(verdict) or suspects or mismatches:
            first = verdict.anomaly
            started = time.perf_counter()
            result, health, moved = self.replay.run(backend, self.monitor, rng, rerun)
            seconds = time.perf_counter() - started
            verdict = self.detector.verdict(health, loss_scaled)
            if first is None:
                again = self._mismatches_again(mismatches, health)
                self.replay.report_suspicion(
                    self._replay_report(), suspects, moved, seconds, mismatches, again
                )
            else:
                self.replay.report(self._replay_report(), first, verdict.anomaly, moved, seconds)
        if verdict.anomaly is not None:
            max_abs = health.host_max_abs
            if max_abs is None:  # a step without max |g|: the report names tensors by it
                max_abs = self.monitor.max_abs(backend.named_grads(), health.grad_factor)
            self.detector.name_tensors(verdict.anomaly, health, max_abs)
        self.health = health
        return result, health, verdict

    def _mismatches_again(self, first: list[list], health: Health) -> list[list]:
        """The checksum mismatches of the first run that the replay computed again: the same
        numbers twice is rounding beyond monitor.checksum.tolerance, not a fault, so those
        tensors are no longer checked (a warning names them)."""
        before = {name for name, _ in first}
        again = [m for m in self.monitor.mismatches(health) if m[0] in before]
        if again:
            self.monitor.stop_checking([name for name, _ in again])
            logger.warning(
                "gradient checksums: %s mismatched again in the replay (residual %s): rounding "
                "beyond monitor.checksum.tolerance=%s; no longer checked",
                ", ".join(name for name, _ in again),
                ", ".join(f"{r:.3g}" for _, r in again),
                self.monitor_cfg.checksum.tolerance,
            )
        return again

    def _replay_report(self) -> ReplayReport:
        return ReplayReport(self.events, self.run.counters, self.run_dir)

    def overflow_at_minimum(self, verdict: Verdict, scale: float) -> None:
        """An FP16 overflow at the minimum loss scale: an anomaly, not another halving."""
        anomaly = self.detector.overflow_at_minimum(scale)
        health = self.health
        assert health is not None
        self.detector.name_tensors(anomaly, health, health.host_max_abs)
        verdict.anomaly, verdict.overflow = anomaly, False

    def after_step(self, result: StepOutcome) -> None:
        if result.overflow:
            update = result.scale_update
            self.events.event(
                "overflow", loss_scale=update.scale, scale_change=update.changed or "none"
            )
        if result.anomaly is None:
            self.consecutive = 0
            self._healthy(result)
            return
        self._anomalous(result)

    # --- healthy and anomalous steps ----------------------------------------------------------

    def _healthy(self, result: StepOutcome) -> None:
        if not result.overflow and self.health is not None:
            self.detector.add(self.health)
            self.monitor.accept(self.health)  # this rank's shard levels (monitor/shards.py)
        if self.arrival is None:  # a rebuild replays counted steps: they count once
            self.targets.healthy_step()
        step = self.run.step
        if not result.skipped and self.targets.is_cadence(step):
            if self.arrival is None:  # a rebuild passes targets that are known already
                self.targets.add(Target(step, self.run.stream.cursor))
            if self.targets.holds_snapshots:
                self.pending = self.targets.at(step)

    def end_step(self) -> None:
        """After the callbacks, whose state a target holds too (INT8 calibration folds the step's
        activations in its on_step_end): the new target's snapshot, then a rebuild's arrival."""
        self._hold_pending()
        if self.arrival is not None and self.run.step >= self.arrival["step"]:
            self._arrive()

    def _hold_pending(self) -> None:
        target, self.pending = self.pending, None
        if target is not None and target.held is None and target.step == self.run.step:
            started = time.perf_counter()
            target.held = self.run.hold()  # on CUDA non-blocking: the loop's share of the copy
            self.snapshots.add(
                time.perf_counter() - started, nested_bytes(target.held.backend_state)
            )

    def _anomalous(self, result: StepOutcome) -> None:
        anomaly = result.anomaly
        step = self.run.step
        self.consecutive += 1
        self.run.counters.anomalies += 1
        # Replicas that disagree are as wrong as a NaN: the same ladder (replay, roll back).
        action = (
            self.monitor_cfg.on_spike if anomaly.kind == "spike" else self.monitor_cfg.nonfinite
        )
        stop = None
        if action == "abort":
            what = "disagreeing replicas" if anomaly.kind == "replica" else "non-finite"
            stop = f"{what} {anomaly.metric} at step {step} (monitor.nonfinite=abort)"
        elif self.consecutive >= self.monitor_cfg.max_consecutive:
            stop = (
                f"{self.consecutive} anomalous steps in a row up to step {step} "
                f"(monitor.max_consecutive={self.monitor_cfg.max_consecutive})"
            )
        result.action = "abort" if stop else action
        self.events.event("anomaly", **anomaly.details(), action=result.action)
        if stop:
            abort(self.run_dir, self.events, stop)
        self.targets.anomaly()
        self.pending = None
        if self.arrival is not None:  # the rebuild went wrong: its target is not reached
            self.arrival = None
        if action == "rollback":
            self._rollback(result)

    # --- the rollback -------------------------------------------------------------------------

    def _rollback(self, result: StepOutcome) -> None:
        run, events = self.run, self.events
        state, stream = run.counters, run.stream
        anomaly_step, anomaly_cursor = state.step, stream.cursor
        committed = self.manager.finish_pending()  # an async checkpoint in flight commits first
        if committed is not None:  # its event, as the checkpoint callback writes it
            events.event("checkpoint", path=str(committed), **self.manager.last_save)
        state.rollbacks += 1
        if state.rollbacks > self.cfg.max_rollbacks:
            abort(
                self.run_dir,
                events,
                f"{state.rollbacks} rollbacks by step {anomaly_step} "
                f"(resilience.max_rollbacks={self.cfg.max_rollbacks})",
            )
        target, repeat = self._target(anomaly_step)
        # Counters of the run survive the restore (they count what happened, not the weights).
        kept = {k: getattr(state, k) for k in ("anomalies", "rollbacks", "transients")}
        held_on = {k: getattr(state, k) for k in ("skipped_steps", "lr_scale", "clip_scale")}
        windows = list(stream.skip_windows)
        older = self.targets.before(target.step)
        found = self.recovery.restore(run, target, older, self.origin)
        if found is None:
            abort(
                self.run_dir,
                events,
                f"anomaly at step {anomaly_step}: the state of step {target.step} "
                "cannot be loaded or rebuilt (no snapshot, checkpoint or start to rebuild it from)",
            )
        source, restored = found
        for key, value in kept.items():
            setattr(state, key, value)
        start, end = target.cursor, anomaly_cursor + self.cfg.skip_margin
        for window in windows:
            stream.add_skip_window(*window)
        stream.add_skip_window(start, end)
        backoff = self._backoff(held_on, target.step, anomaly_step)
        self.targets.drop_after(target.step)
        self.last = (target.step, anomaly_step)
        if restored == target.step:
            self._apply(state, backoff)
        else:  # a rebuild: the back-off starts where the target is reached again
            self.arrival = {"step": target.step, "from_step": restored, **backoff}
        # Checkpoints of the abandoned steps would replay the bad data after a restart: retire
        # them, and checkpoint the restored state with its new skip window right away.
        retired = self.manager.retire_after(restored) if self.replicas.leads else []
        result.rolled_back = result.checkpoint_now = True
        # The three events belong to the anomaly's step (the state now reads the restored one).
        events.event(
            "rollback",
            at_step=anomaly_step,
            from_step=anomaly_step,
            to_step=target.step,
            source=source,
            replay_steps=target.step - restored,
            repeat=repeat,
            rollbacks=state.rollbacks,
            retired_checkpoints=retired,
        )
        events.event("skip_data", at_step=anomaly_step, start=start, end=end, samples=end - start)
        events.event(
            "lr_backoff",
            at_step=anomaly_step,
            factor=self.cfg.lr_backoff,
            lr_scale=backoff["lr_scale"],
            clip_scale=backoff["clip_scale"],
            until_step=backoff["backoff_until"],
        )

    def _target(self, anomaly_step: int) -> tuple[Target, bool]:
        """The newest good target before the anomaly; a repeat within `resilience.window` steps
        of the last rollback goes before that one's target. (target, repeat)"""
        repeat = self.last is not None and anomaly_step - self.last[0] <= self.cfg.window
        bound = self.last[0] if repeat else anomaly_step
        target = self.targets.choose(bound)
        if target is None and repeat and self.last[1] != anomaly_step:
            # Nothing before the start, which is good by definition (the repeat cannot be its
            # fault): back to it again, with a longer skip window and a lower LR, unless the
            # anomaly came back at the very same step (nothing the ladder changed helped).
            target = self.targets.start
        if target is None:
            again = f", again within {self.cfg.window} steps of the rollback" if repeat else ""
            abort(
                self.run_dir,
                self.events,
                f"anomaly at step {anomaly_step}{again}: no good snapshot or checkpoint before "
                f"step {bound} to roll back to",
            )
        return target, repeat

    def _backoff(self, held_on: dict[str, Any], target_step: int, anomaly_step: int) -> dict:
        """LR and clipping scaled down, compounding on repeats, from the target for the cooldown
        (resilience.lr_cooldown_steps; by default twice the steps rolled back), never past the
        run's end; 0: for the rest of the run."""
        cooldown = self.cfg.lr_cooldown_steps
        if cooldown is None:
            cooldown = max(2 * (anomaly_step - target_step), 1)
        until = min(target_step + cooldown, self.max_steps) if cooldown > 0 else -1
        return {
            "lr_scale": held_on["lr_scale"] * self.cfg.lr_backoff,
            "clip_scale": held_on["clip_scale"] * self.cfg.clip_backoff,
            "backoff_until": until,
            "skipped_steps": held_on["skipped_steps"],
        }

    @staticmethod
    def _apply(state, backoff: dict[str, Any]) -> None:
        for key in ("lr_scale", "clip_scale", "backoff_until", "skipped_steps"):
            setattr(state, key, backoff[key])

    def _arrive(self) -> None:
        """A rebuild reached its target: the state is the target's; the back-off starts."""
        arrival, self.arrival = self.arrival, None
        self._apply(self.run.counters, arrival)
        self.events.event(
            "rebuilt",
            to_step=arrival["step"],
            from_step=arrival["from_step"],
            replayed_steps=arrival["step"] - arrival["from_step"],
        )

    # --- checkpoints ----------------------------------------------------------------------------

    def host_state(self) -> dict[str, Any] | None:
        """This rank's host copy of the current step's backend state when a target of the step is
        held (its snapshot taken now if due this step): a checkpoint of the step writes from it
        instead of copying again."""
        step = self.run.step
        if self.pending is not None and self.pending.step == step:
            self._hold_pending()
        target = self.targets.at(step)
        return target.held.backend_state if target is not None and target.held else None

    def state_dict(self) -> dict[str, Any]:
        start = self.targets.start
        return {
            "targets": self.targets.state_dict(),
            "start": [start.step, start.cursor],
            "origin": self.origin,
            "last": list(self.last) if self.last else None,
            "arrival": self.arrival,
            "consecutive": self.consecutive,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.targets.load_state_dict(state["targets"])
        step, cursor = state["start"]
        self.targets.start = Target(step, cursor, healthy_after=self.cfg.confirm_steps)
        self.origin = state["origin"]
        self.last = tuple(state["last"]) if state["last"] else None
        self.arrival = state["arrival"]
        self.consecutive = state["consecutive"]
