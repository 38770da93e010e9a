"""What setup hands the loop and its callbacks, typed and frozen: what was built (RunSetup) and
where the run starts (StartPoint). bigtrain.build assembles both; nothing writes them later."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bigtrain.data.prepare.summary import CorpusSummary
from bigtrain.parallel.layout import Layout
from bigtrain.precision import PrecisionPolicy


@dataclass(frozen=True)
class RunSetup:
    """What was built: the parallel layout, the precision policy, the model's size and shapes,
    the throughput yardsticks, what a checkpoint must match on resume, and the corpus."""

    layout: Layout  # where this rank sits, with its DeviceMesh (parallel/layout.py)
    policy: PrecisionPolicy
    num_params: int
    shapes: dict[str, list[int]]  # by canonical name: what a checkpoint must hold
    flops_per_token: float
    peak_flops: float | None  # per device, for MFU; None: unknown
    peak_flops_source: str
    identity: dict[str, Any]  # what may not change on resume (resume.run_identity)
    config_yaml: str  # the config as given, saved in the run directory and each checkpoint
    corpus: CorpusSummary
    monitor_kernel: str  # triton or torch
    build_site: str  # partitioned, meta or whole (parallel/model_setup.py)
    skipped_rows: dict[str, int] = field(default_factory=dict)  # unreadable rows by file
    fp8_layers: dict[str, Any] = field(default_factory=dict)  # Fp8Linear by name (precision/fp8.py)


@dataclass(frozen=True)
class StartPoint:
    """Where the run starts: `resume` (the resume event's details) when it continues a checkpoint,
    `init_from` (the init_from event's) when a new run takes model.init_from's weights; neither:
    a fresh run. Also what setup passed over on the way."""

    resume: dict[str, Any] | None = None
    init_from: dict[str, Any] | None = None
    invalid_checkpoints: tuple[dict[str, str], ...] = ()  # committed, but failed verification
    fault_corrupted: str | None = None  # the file drill.corrupt_checkpoint damaged
