"""The training loop: small on purpose. Everything else plugs in through the hooks in hooks.py."""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from bigtrain.config.schema import Config, OptimConfig
from bigtrain.data.read.stream import BatchLoader
from bigtrain.errors import ReplicaMismatch
from bigtrain.monitor.monitor import GradMonitor, Health
from bigtrain.parallel.backends.base import Backend
from bigtrain.parallel.env import DistEnv
from bigtrain.parallel.replicas.groups import NoReplicaGroups, ReplicaGroups
from bigtrain.precision.clip import ClipThreshold
from bigtrain.resilience import Healer
from bigtrain.state.run import Cadence, Counters, RunState
from bigtrain.store.rundir import RunDir
from bigtrain.telemetry.memory import memory_kind, peak_memory_bytes
from bigtrain.telemetry.profile import NO_RANGES, NoRanges, PhaseRanges
from bigtrain.train.hooks import Callbacks
from bigtrain.train.setup import RunSetup
from bigtrain.train.step import StepResult
from bigtrain.train.timing import StepTimer
from bigtrain.utils.dist import all_gather_objects


def lr_at(step: int, max_steps: int, cfg: OptimConfig) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warmup, then the decay schedule."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    floor = cfg.lr * cfg.min_lr_ratio
    if cfg.schedule == "constant" or max_steps <= cfg.warmup_steps:
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, max_steps - cfg.warmup_steps))
    if cfg.schedule == "linear":
        return cfg.lr - (cfg.lr - floor) * progress
    return floor + 0.5 * (cfg.lr - floor) * (1 + math.cos(math.pi * progress))


class Trainer:
    """Holds the run's parts; `fit()` runs the loop, `final_record()` says how it ended. Built by
    bigtrain.build.build."""

    def __init__(
        self,
        cfg: Config,
        env: DistEnv,
        backend: Backend,
        loader: BatchLoader,
        run_dir: RunDir,
        callbacks: Callbacks,
        device: torch.device,
        setup: RunSetup,
        monitor: GradMonitor,
        healer: Healer,
        replicas: ReplicaGroups | NoReplicaGroups | None = None,
    ) -> None:
        self.cfg, self.env, self.backend, self.loader, self.run_dir = (
            cfg,
            env,
            backend,
            loader,
            run_dir,
        )
        self.callbacks, self.device, self.monitor = callbacks, device, monitor
        self.healer = healer  # detect, replay, decide, roll back: called by name (resilience/)
        # fault-tolerant replica groups (parallel/replicas/groups.py): the quorum, cross-group means, commit
        self.replicas = replicas if replicas is not None else NoReplicaGroups()
        self.setup = setup  # what was built: policy, shapes, FLOPs per token, identity, corpus
        self.state = Counters()
        self.policy = setup.policy
        self.phase = self.policy.phases[0]  # the backend starts in the first phase
        p = cfg.precision
        self.clip = ClipThreshold(
            cfg.optim.grad_clip,
            self.policy.adaptive_clip,
            p.adaptive_clip_percentile,
            p.adaptive_clip_window,
        )
        self.tokens_per_step = loader.global_batch_size * cfg.model.seq_len
        self.stop_signal: str | None = None  # request_stop: a preemption signal's name
        self.replaying = False  # True while a step's micro-batches run the second time
        self.step_in_progress: int | None = None  # the step train_step is running
        self.timer = StepTimer(device, cfg.monitor.timing_every)
        self.ranges: PhaseRanges | NoRanges = NO_RANGES  # use_ranges: while profiling
        # The evaluation before a fresh run's first step (record_start), the curve's first point.
        self.start_record: dict[str, Any] | None = None
        self.run = self._run_state()
        self.cadence = Cadence(self.end_step, cfg.train.log_every, cfg.checkpoint.every)
        self.healer.attach(self.run, self, monitor, self.replicas, run_dir)
        self.replicas.attach(self.run, self, run_dir, self.cadence)

    def _run_state(self) -> RunState:
        """The run's state, part by part (bigtrain/state/run.py): what checkpoints, a rejoining
        group's transfer and rollback snapshots hold. Registered in the order they load."""
        run = RunState(
            self.backend,
            self.state,
            self.loader.stream,
            self.loader.global_batch_size,
            self.tokens_per_step,
        )
        run.add("clip", self.clip, missing={"history": []})
        run.add("monitor", self.healer.detector, missing={})
        run.add("local", LocalShards(self.monitor, self.healer), missing={})
        run.add("callbacks", self.callbacks, missing={})
        # torchft's step only grows: a rollback does not take it back.
        run.add("replicas", self.replicas, rollback=False, missing={})
        if self.backend.scaler is not None:
            run.add("loss_scaler", self.backend.scaler)
        run.add("resilience", self.healer, rollback=False)  # its own bookkeeping
        return run

    @property
    def step(self) -> int:
        return self.state.step

    # What callbacks ask of the trainer (they observe; the trainer owns its state).
    def request_stop(self, reason: str) -> None:
        """Checkpoint and stop at the next step boundary that every rank reaches together (a
        preemption signal, callbacks/preempt.py): the request rides in the monitor's all-reduce."""
        self.stop_signal = reason

    def record_start(self, record: dict[str, Any]) -> None:
        """The metrics of the state the run starts from (the evaluation before a fresh run's
        first step), written as the curve's first point by the metrics logger and the sinks."""
        self.start_record = record

    def use_ranges(self, ranges: PhaseRanges | NoRanges) -> None:
        """Mark the loop's phases as profiler ranges (PhaseRanges), or not (NO_RANGES)."""
        self.ranges = ranges

    def event(self, kind: str, at_step: int | None = None, **details: Any) -> dict[str, Any]:
        """Write an event (rank 0) and let callbacks (console, wandb) hear of it. During a step,
        events carry that step's number; between steps, the last finished step's; `at_step`
        where the state no longer tells (a rollback's events: the anomaly's step)."""
        step = self.step_in_progress if self.step_in_progress is not None else self.state.step
        step = at_step if at_step is not None else step
        record = self.run_dir.event(step, kind, **details)
        self.callbacks.on_event(self, record)
        return record

    @property
    def end_step(self) -> int:
        """The step this process stops at: max_steps, or train.stop_at_step when earlier."""
        stop = self.cfg.train.stop_at_step
        return min(self.cfg.train.max_steps, stop) if stop is not None else self.cfg.train.max_steps

    def is_last_step(self) -> bool:
        """True after the last step this process runs (logging, eval and checkpoint are due)."""
        return self.state.step >= self.end_step

    def fit(self, resumed: bool = False) -> Counters:
        """The loop. `resumed`: the state was loaded from a checkpoint (the healer's targets
        came with it)."""
        self.callbacks.on_start(self)
        self.healer.start(resumed)
        while self.state.step < self.end_step:
            result = self.train_step()
            if result is None:  # not committed: a replica group failed inside it; run it again
                continue
            self.healer.after_step(result)  # events, the action, a rollback
            self.callbacks.on_step_end(self, result)
            self.replicas.after_step(result)  # a slow replica group may leave the job
            self.ranges.begin("checkpoint_copy")
            self.healer.end_step()  # a new rollback target's snapshot
            self.ranges.end()
        # Replica groups: every group at the end, caught up and holding the same weights.
        self.replicas.finish()
        self.callbacks.on_finish(self)
        return self.state

    def final_record(self, started: float) -> dict[str, Any]:
        """final.json's figures, from the loop's own state; every rank computes the fingerprint
        and the ranks compare it (ReplicaMismatch when they differ)."""
        fingerprint = self.backend.fingerprint()
        fingerprints = all_gather_objects(fingerprint)
        if len(set(fingerprints)) != 1:
            reason = "replicas disagree on the final weights"
            self.event("error", reason=reason, fingerprints=fingerprints)
            raise ReplicaMismatch(f"ranks hold different final weights: {fingerprints}")
        state = self.state
        return {
            "step": state.step,
            "loss": state.last_loss,
            "tokens": state.tokens_seen,
            "samples": state.samples_seen,
            "anomalies": state.anomalies,
            "rollbacks": state.rollbacks,
            "skipped_steps": state.skipped_steps,
            **(
                {"tokens_skipped_by_group": state.tokens_skipped_by_group}
                if state.tokens_skipped_by_group
                else {}
            ),
            "fingerprint": fingerprint,
            "wall_s": round(time.time() - started, 2),
            "peak_memory_bytes_by_rank": all_gather_objects(peak_memory_bytes(self.device)),
            "peak_memory_kind": memory_kind(self.device),
        }

    def train_step(self) -> StepResult | None:
        """One optimizer step; None when the replica groups did not commit it (nothing of it
        was applied: it runs again) or when the quorum brought a peer's state at the end."""
        cfg, backend = self.cfg, self.backend
        started = time.perf_counter()
        before = self.state.step
        self.replicas.start_step()  # the quorum: a rejoining group takes a peer's state here
        if self.state.step != before and self.state.step >= self.end_step:
            return None  # the peer's state it took is the end's: nothing left to train
        self._enter_phase()
        self.healer.before_step()
        lr = lr_at(self.state.step, cfg.train.max_steps, cfg.optim) * self.state.lr_scale
        step = self.step_in_progress = self.state.step + 1
        self.timer.start(step)
        self.ranges.begin("data")
        undo = self.replicas.undo_point()
        micro_batches = self.loader.next_step()
        self.timer.mark("data")
        rng = self.healer.replay.before_step()  # the step's RNG state, kept for a replay

        def forward_backward() -> tuple[StepResult, Health]:
            return self._forward_backward_check(micro_batches, step, lr)

        def replay() -> tuple[StepResult, Health]:
            """The step's micro-batches once more (the healer's replay): drills that model a
            transient fault know it by `replaying`."""
            self.replaying = True
            try:
                return forward_backward()
            finally:
                self.replaying = False

        result, health = forward_backward()
        verdict = None  # a reduction across replica groups failed: nothing to judge or apply
        if self.replicas.intact():
            result, health, verdict = self.healer.judge(result, health, rng, replay)
        if not self.replicas.commit() or verdict is None:
            self.replicas.abandon(undo, step)
            self.step_in_progress = None
            return None
        if verdict.skip:
            backend.skip_step()
            self.state.skipped_steps += 1
        else:
            self.ranges.begin("clip")
            backend.clip_grads(self.clip.value() * self.state.clip_scale, health.grad_norm)
            self.ranges.begin("optimizer")
            backend.step(lr)
            if self.clip.adaptive:
                self.clip.record(health.host_grad_norm)
        self.timer.mark("optimizer")
        scale = backend.update_loss_scale(overflow=verdict.overflow)
        if scale is not None:
            result.loss_scale, result.scale_update = scale.scale, scale
            if scale.at_min:  # overflow at the minimum scale: halving again would loop forever
                self.healer.overflow_at_minimum(verdict, scale.scale)
        self.ranges.end()
        result.anomaly, result.overflow = verdict.anomaly, verdict.overflow
        result.skipped, result.preempt = verdict.skip, health.stop_requested
        result.finite = verdict.finite
        result.precision_phase = self.phase.name
        self.state.step += 1
        # The step's loss as the monitor read it to the host: a checkpoint of any step, logged
        # or not, and final.json take it from the state.
        self.state.last_loss = health.host_loss
        self.step_in_progress = None
        self.state.samples_seen += self.loader.global_batch_size
        self.state.tokens_seen += self.tokens_per_step
        result.step_timing = self.timer.finish()  # per part, on timing steps; else None
        # The step's own time; callbacks (eval, checkpoints) are not included.
        result.step_time = time.perf_counter() - started
        self.replicas.annotate(result)  # each replica group's own loss, at log steps
        return result

    def _forward_backward_check(
        self, micro_batches: list, step: int, lr: float
    ) -> tuple[StepResult, Health]:
        """Forward and backward of the step's micro-batches, then the monitor's numbers."""
        backend = self.backend
        self.monitor.begin(step)  # the checksums' expected side, from this step's forwards
        self.callbacks.on_before_forward(self, step)
        self.ranges.begin("forward_backward")
        n = len(micro_batches)
        losses = [backend.forward_backward(x, y, i, n) for i, (x, y) in enumerate(micro_batches)]
        result = StepResult(step, lr, local_loss=torch.stack(losses).mean())
        self.callbacks.on_after_backward(self, result)
        # This rank's own work ends here; the wait for other replica groups counts as `sync`.
        self.timer.mark("forward_backward")
        self.replicas.average_grads(
            backend
        )  # over the live replica groups (parallel/replicas/groups.py)
        self.ranges.begin("monitor")
        grad_factor = backend.unscale_grads()
        log_step = step % self.cfg.train.log_every == 0 or step >= self.end_step
        # One pass over the gradients and one or two small all-reduces; every rank then holds the
        # same numbers and takes the same decision (step, skip, anomaly).
        health = self.monitor.check(
            backend.named_grads(),
            result.local_loss,
            grad_factor,
            full=self.monitor.full_step(step, log_step),
            stop_requested=self.stop_signal is not None,
            loss_scale=backend.loss_scale() or 1.0,
        )
        self.timer.mark("sync")
        result.local_loss = None
        result.loss, result.grad_norm, result.telemetry = (
            health.loss,
            health.grad_norm,
            health.telemetry,
        )
        return result, health

    def _enter_phase(self) -> None:
        """Switch precision phase when this step crosses into a new one (also right after a resume)."""
        phase = self.policy.phase_at(self.state.step, self.cfg.train.max_steps)
        if phase != self.phase:
            self.event(
                "precision_phase", previous=self.phase.name, phase=phase.name, until=phase.until
            )
            self.backend.set_phase(phase)
            self.phase = phase


class LocalShards:
    """The `local` part of the run's state: this rank's own shard history (the suspicion tier,
    monitor/shards.py). Loaded empty (another world size wrote the checkpoint, or the run's start
    is rebuilt), the suspicion tier's history starts again with it."""

    def __init__(self, monitor: GradMonitor, healer: Healer) -> None:
        self.monitor, self.healer = monitor, healer

    def state_dict(self) -> dict[str, Any]:
        return self.monitor.local_state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.monitor.load_local_state_dict(state)
        if not state:
            self.healer.detector.suspicion.load_state_dict({})
