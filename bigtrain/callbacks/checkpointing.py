"""Checkpoint every `checkpoint.every` steps, at the last step and right after a rollback, through
the atomic commit; only states checked finite on every rank are written."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from bigtrain.checkpoint.manager import CheckpointManager
from bigtrain.config.schema import CheckpointConfig
from bigtrain.monitor.stats import local_grad_stats
from bigtrain.train.hooks import Callback
from bigtrain.train.step import StepResult


def nonfinite_state_values(backend, device: torch.device) -> int:
    """NaN/Inf values in master weights and optimizer states over all ranks (the monitor's pass
    over the state tensors, one all-reduce)."""
    stats = local_grad_stats(backend.state_tensors(), device, full=False)
    count = stats.nonfinite.sum().reshape(1)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(count, op=dist.ReduceOp.SUM)
    # Expensive device-to-host synchronization, at checkpoint steps only.
    return int(count.item())


class CheckpointCallback(Callback):
    def __init__(self, manager: CheckpointManager, cfg: CheckpointConfig) -> None:
        self.manager, self.cfg = manager, cfg

    def on_step_end(self, trainer, result: StepResult) -> None:
        committed = self.manager.poll_pending()
        if committed is not None:
            self._committed(trainer, committed)
        step, every = trainer.step, self.cfg.every
        due = (trainer.is_last_step() and every >= 0) or (every > 0 and step % every == 0)
        # With replica groups, the group leading the quorum writes (they hold the same state).
        if (due or result.checkpoint_now or result.preempt) and trainer.replicas.leads:
            self.save(trainer, wait=trainer.is_last_step() or result.preempt)

    def save(self, trainer, wait: bool) -> None:
        committed = self.manager.finish_pending()  # one in flight at a time: the last one first
        if committed is not None:
            self._committed(trainer, committed)
        if self.cfg.verify_finite:
            bad = nonfinite_state_values(trainer.backend, trainer.device)
            if bad:
                trainer.event("checkpoint_refused", reason=f"{bad} non-finite state values")
                return
        started = time.perf_counter()
        trainer.ranges.begin("checkpoint_save")  # a named range while profiling
        path = self.manager.save(
            trainer.step,
            trainer.backend,
            trainer.run.state_dict(),
            trainer.setup.identity,
            trainer.setup.config_yaml,
            async_ok=self.cfg.async_save and not wait,
            # A snapshot of this step (a rollback target) is a host copy already: written from.
            host_state=trainer.healer.host_state(),
            shapes=trainer.setup.shapes,
        )
        trainer.ranges.end()
        if path is None:
            trainer.event("checkpoint_started", stall_s=round(time.perf_counter() - started, 4))
            return
        self._committed(trainer, path)

    def _committed(self, trainer, path) -> None:
        """The `checkpoint` event, with what the manager measured (CheckpointManager.last_save:
        seconds from the save's start, the loop's stall_s, async, write_s, bytes_per_rank)."""
        trainer.event("checkpoint", path=str(path), **self.manager.last_save)

    def on_finish(self, trainer) -> None:
        path = self.manager.finish_pending()
        if path is not None:
            self._committed(trainer, path)

    def on_stop(self, trainer, reason: str) -> None:
        # The checkpoint in flight holds a state that was healthy and checked finite: commit it
        # (every rank stops at the same step, so the commit's collectives meet).
        self.on_finish(trainer)
