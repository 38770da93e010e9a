"""StepResult: one optimizer step as the loop hands it to the callbacks.

The loop fills what it measured, the healer (bigtrain/resilience) what it decided (`action`,
`rolled_back`, `checkpoint_now`) before any callback runs; callbacks read typed fields, and the few
that add to the step write their own field (evaluation `val_loss`, the straggler report
`step_time_by_rank` and `peak_memory_bytes_by_rank`, the metrics logger `record`, text samples
`samples`). Who writes a field runs before who reads it (the callbacks' one order, build.py make_callbacks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from bigtrain.model.generate import Sample
    from bigtrain.precision.scaler import ScaleUpdate
    from bigtrain.resilience.detect import Anomaly


@dataclass
class StepResult:
    step: int
    """The optimizer step this is (1 for the first)."""
    lr: float
    """The learning rate the step used (schedule x back-off)."""
    local_loss: torch.Tensor | None = None
    """This rank's mean loss over its micro-batches (device), until the monitor reduces it; the
    after-backward hooks may change it (fault drills)."""
    loss: torch.Tensor | None = None
    """Mean loss over all ranks (device tensor)."""
    grad_norm: torch.Tensor | None = None
    """Global gradient norm before clipping, unscaled (device tensor)."""
    telemetry: dict[str, Any] = field(default_factory=dict)
    """The monitor's logged numbers (per-layer norms and maxima, non-finite counts)."""
    anomaly: Anomaly | None = None
    overflow: bool = False
    """FP16 overflow under dynamic loss scaling: skipped and backed off, not an anomaly."""
    skipped: bool = False
    """The optimizer step was not applied."""
    finite: bool = True
    preempt: bool = False
    """Some rank got a preemption signal: every rank checkpoints and stops after this step."""
    precision_phase: str = ""
    loss_scale: float | None = None
    scale_update: ScaleUpdate | None = None
    step_timing: dict[str, float] | None = None
    """This rank's seconds per part of the step, on timing steps (train/timing.py)."""
    step_time: float = 0.0
    """Seconds of the step itself (callbacks not included)."""
    # Written by the healer:
    action: str | None = None
    """The healer's decision on an anomaly: rollback, skip, warn or abort."""
    rolled_back: bool = False
    checkpoint_now: bool = False
    """Checkpoint at this step whatever checkpoint.every says (after a rollback)."""
    # Written by callbacks:
    val_loss: float | None = None
    step_time_by_rank: dict[str, list[float]] | None = None
    peak_memory_bytes_by_rank: list[int] | None = None
    """Each rank's peak memory (telemetry/memory.py), on timing steps (the straggler report)."""
    slow_groups: dict[int, int] | None = None
    """Replica groups named the straggler at this timing step, with how many timing steps in a
    row (the straggler report); the replica groups' policy reads it (parallel/replicas/groups.py)."""
    record: dict[str, Any] | None = None
    """The metrics line written at this step, if one was (console and wandb read it)."""
    samples: list[Sample] | None = None
    """Text generated at this step (eval.sample_every), one per prompt; wandb reads it."""

    def logged(self) -> dict[str, Any]:
        """The step's numbers for a metrics line (device tensors not yet read)."""
        out: dict[str, Any] = {"step": self.step, "lr": self.lr}
        out.update(loss=self.loss, grad_norm=self.grad_norm, **self.telemetry)
        if self.loss_scale is not None:
            out["loss_scale"] = self.loss_scale
        out["precision_phase"] = self.precision_phase
        if self.val_loss is not None:
            out["val_loss"] = self.val_loss
        if self.step_time_by_rank is not None:
            out["step_time_by_rank"] = self.step_time_by_rank
        if self.peak_memory_bytes_by_rank is not None:
            out["peak_memory_bytes_by_rank"] = self.peak_memory_bytes_by_rank
        return out
