"""Coordinated rollback: host-memory snapshots and the ladder that acts on the monitor's anomalies.

Every rank takes the same decision in the same step, because the monitor's numbers are identical on
every rank (one all-reduce); so every rank restores the same step, adds the same skip window and
backs off the same way, with no extra agreement round. The snapshot ring holds this rank's shard
only (`Backend.local_state`); a snapshot counts as good once `confirm_steps` healthy steps followed
it. The state the run started from (its initialisation, or the verified checkpoint it resumed
from) is a snapshot that is good by definition, so an anomaly at any step can roll back, also
early in training, where blow-ups are most common. Without a good snapshot before the anomaly the
newest verified disk checkpoint before it is loaded.
"""

from __future__ import annotations

import copy
from collections import deque
from dataclasses import dataclass
from typing import Any

from bigtrain.callbacks.guard import abort
from bigtrain.config.schema import ResilienceConfig
from bigtrain.store.checkpoint import (
    CheckpointError,
    CheckpointManager,
    rng_state,
    set_rng_state,
)
from bigtrain.train import HostCopy
from bigtrain.train.hooks import Callback
from bigtrain.train.step import StepResult


@dataclass
class Snapshot:
    step: int
    backend_state: dict[str, Any]  # this rank's shard, on the host
    trainer_state: dict[str, Any]  # counters, data cursor and skip windows, clip, monitor, scaler
    rng: dict[str, Any]
    healthy_after: int = 0  # healthy steps since it was taken


class Rollback(Callback):
    """Takes snapshots on healthy steps; on an anomaly whose action is `rollback`, restores."""

    priority = 2  # after the anomaly guard's event, before evaluation and checkpointing

    def __init__(self, cfg: ResilienceConfig, manager: CheckpointManager) -> None:
        self.cfg, self.manager = cfg, manager
        self.ring: deque[Snapshot] = deque(maxlen=max(cfg.snapshots, 1))
        self.origin: Snapshot | None = None  # the state the run started from: good by definition
        self.last: tuple[int, int] | None = None  # (step restored to, anomaly step) of the last one

    def on_start(self, trainer) -> None:
        if self.cfg.snapshot_every > 0:  # snapshots on: keep one of the starting state too
            self.origin = self._snapshot(trainer)
            self.origin.healthy_after = self.cfg.confirm_steps

    def on_step_end(self, trainer, result: StepResult) -> None:
        anomaly = result.anomaly
        if anomaly is None:
            for snap in self.ring:
                snap.healthy_after += 1
            every = self.cfg.snapshot_every
            if every > 0 and trainer.step % every == 0 and not result.skipped:
                self.take(trainer)
            return
        for snap in self.ring:
            if snap.healthy_after < self.cfg.confirm_steps:
                snap.healthy_after = -(10**9)  # an anomaly before it was confirmed: never good
        if result.action == "rollback":
            self.rollback(trainer, result)

    def take(self, trainer) -> None:
        snapshot = self._snapshot(trainer)
        self.ring.append(snapshot)
        # A checkpoint of this step writes from it instead of copying again.
        trainer.host_copy = HostCopy(trainer.step, snapshot.backend_state)

    @staticmethod
    def _snapshot(trainer) -> Snapshot:
        # Host copies of this rank's shard (pinned, non-blocking on CUDA; see Backend.local_state).
        state = trainer.backend.local_state()
        return Snapshot(trainer.step, state, copy.deepcopy(trainer.trainer_state()), rng_state())

    def rollback(self, trainer, result: StepResult) -> None:
        state = trainer.state
        anomaly_step, anomaly_cursor = state.step, trainer.loader.stream.cursor
        self.manager.finish_pending()  # an async checkpoint in flight commits first
        state.rollbacks += 1
        if state.rollbacks > self.cfg.max_rollbacks:
            abort(
                trainer,
                f"{state.rollbacks} rollbacks by step {anomaly_step} "
                f"(resilience.max_rollbacks={self.cfg.max_rollbacks})",
            )
        # A repeat within `window` steps of the last rollback goes one snapshot further back.
        bound = anomaly_step
        repeat = self.last is not None and anomaly_step - self.last[0] <= self.cfg.window
        if repeat:
            bound = self.last[0]
        # Counters of the run survive the restore (they count what happened, not the weights).
        kept = {
            k: getattr(state, k)
            for k in ("anomalies", "rollbacks", "skipped_steps", "lr_scale", "clip_scale")
        }
        kept["transients"] = state.transients
        windows = list(trainer.loader.stream.skip_windows)
        source, restored = self._restore(trainer, bound, anomaly_step, repeat)
        # The host copy is of an abandoned step: the new timeline reaches that step number again
        # with other weights, and a checkpoint there would write these.
        trainer.host_copy = None
        state = trainer.state  # load_trainer_state made a new one
        for key, value in kept.items():
            setattr(state, key, value)
        stream = trainer.loader.stream
        start, end = stream.cursor, anomaly_cursor + self.cfg.skip_margin
        for window in windows:
            stream.add_skip_window(*window)
        stream.add_skip_window(start, end)
        # Back off: LR and clipping, compounding on repeats, for the cooldown (or for good).
        state.lr_scale *= self.cfg.lr_backoff
        state.clip_scale *= self.cfg.clip_backoff
        cooldown = self.cfg.lr_cooldown_steps
        state.backoff_until = restored + cooldown if cooldown > 0 else -1
        self.last = (restored, anomaly_step)
        # Checkpoints of the abandoned steps would replay the bad data after a restart: retire
        # them, and checkpoint the restored state with its new skip window right away.
        retired = self.manager.retire_after(restored)
        result.rolled_back = result.checkpoint_now = True
        # The three events belong to the anomaly's step (the state now reads the restored one).
        trainer.event(
            "rollback",
            at_step=anomaly_step,
            from_step=anomaly_step,
            to_step=restored,
            source=source,
            repeat=repeat,
            rollbacks=state.rollbacks,
            retired_checkpoints=retired,
        )
        trainer.event("skip_data", at_step=anomaly_step, start=start, end=end, samples=end - start)
        trainer.event(
            "lr_backoff",
            at_step=anomaly_step,
            factor=self.cfg.lr_backoff,
            lr_scale=state.lr_scale,
            clip_scale=state.clip_scale,
            until_step=state.backoff_until,
        )

    def _restore(self, trainer, bound: int, anomaly_step: int, repeat: bool) -> tuple[str, int]:
        """Load the newest good state before step `bound`: a snapshot (the starting state
        included), else a verified checkpoint; abort when there is none. (source, step)."""
        good = [s for s in self.ring if s.healthy_after >= self.cfg.confirm_steps]
        if self.origin is not None:
            good.insert(0, self.origin)
        target = next((s for s in reversed(good) if s.step < bound), None)
        if target is None and repeat and self._origin_again(bound, anomaly_step):
            target = self.origin
        if target is not None:
            trainer.backend.load_local_state(target.backend_state)
            trainer.load_trainer_state(copy.deepcopy(target.trainer_state))
            set_rng_state(target.rng)
            while self.ring and self.ring[-1] is not target:
                self.ring.pop()  # newer snapshots belong to the abandoned future
            return "memory", target.step
        found = self._disk_target(bound)
        if found is None:
            again = f", again within {self.cfg.window} steps of the rollback" if repeat else ""
            abort(
                trainer,
                f"anomaly at step {anomaly_step}{again}: no good snapshot or checkpoint before "
                f"step {bound} to roll back to",
            )
        trainer.load_trainer_state(self.manager.load(found, trainer.backend))
        self.ring.clear()
        return "disk", trainer.step

    def _origin_again(self, bound: int, anomaly_step: int) -> bool:
        """A repeat after a rollback to the starting state has nothing further back, but that
        state is good by definition (the repeat cannot be its fault): go back to it again, with
        a longer skip window and a lower LR, unless the anomaly came back at the very same step
        (nothing the ladder changed helped: the repeated anomalies at one target end the run)."""
        return (
            self.origin is not None
            and self.origin.step == bound
            and self.last is not None
            and anomaly_step != self.last[1]
        )

    def _disk_target(self, bound: int):
        """The newest verified checkpoint written before step `bound` (checked finite on write)."""
        for path in reversed(self.manager.committed()):
            step = int(path.name.rsplit("_", 1)[1])
            if step >= bound:
                continue
            try:
                self.manager.verify(path)
                return path
            except CheckpointError:  # a bad one is skipped; older ones are tried
                continue
        return None
