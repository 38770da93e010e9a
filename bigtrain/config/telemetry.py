"""The observability sections: `profile.*` (profiler traces and memory snapshots on request) and
`log.*` (where metrics, events and the run's figures go besides metrics.jsonl), and the checks of
their keys that the type alone does not make (called by config/load.py's `validate`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from bigtrain.errors import ConfigError

SINKS = ("wandb", "tensorboard", "mlflow")


@dataclass
class ProfileConfig:
    steps: list[int] = field(default_factory=list)
    """`[start, end]`: trace the optimizer steps start..end (inclusive) with torch.profiler, after
    `warmup` steps that run under the profiler unrecorded (torch.profiler.schedule). Each rank in
    `ranks` writes RUN_DIR/profile/rank<r>.<start>.pt.trace.json (Chrome/Perfetto JSON; TensorBoard's
    profiler plugin reads the folder) and a `profile` event names it. The loop's phases are named
    ranges in it. Steps are counted as the loop runs them: a rollback's replayed steps count again.
    Empty: off, and no profiler object exists. Read at start."""
    warmup: int = 1
    """Steps before `start` that run under the profiler without being recorded (its start-up cost
    stays out of the trace); fewer when the run starts later than start - warmup."""
    ranks: list[int] = field(default_factory=lambda: [0])
    """Ranks that profile; the others run as if profiling were off."""
    record_shapes: bool = False
    """Record the input shapes of every operator (larger traces)."""
    with_stack: bool = False
    """Record the Python stack of every operator (much larger traces, slower steps)."""
    gzip: bool = False
    """Write traces as `.pt.trace.json.gz` (TensorBoard and Perfetto read both)."""
    memory: bool = False
    """CUDA: record the caching allocator's history (every allocation with its stack) over the
    profiled steps, or from the first step when `steps` is empty, and dump it as
    RUN_DIR/profile/rank<r>.<start>.memory.pickle for https://pytorch.org/memory_viz; an
    out-of-memory error then dumps the history up to it (RUN_DIR/memory/). On a CPU there is no
    allocator history: a logged note, and peak host RSS in the metrics as always. Read at start."""


@dataclass
class LogConfig:
    sinks: list[str] = field(default_factory=lambda: ["wandb"])
    """Where metric records, events, the resolved config and precision policy and final.json's
    figures go besides metrics.jsonl and events.jsonl: any of `wandb` (off while wandb.mode is
    disabled), `tensorboard` (event files under RUN_DIR/tensorboard/; `pip install
    bigtrain[tensorboard]`), `mlflow` (MLFLOW_TRACKING_URI when set, else
    sqlite:///RUN_DIR/mlflow.db; `pip install bigtrain[mlflow]`). Every sink gets the same
    records: the trajectory the run kept (see `hold_steps`). A sink whose package is missing is a
    config error (exit 2). Rank 0 only. At start."""
    hold_steps: int | None = None
    """Metric records reach the sinks this many steps after their own step, so that a rollback can
    drop those of the steps it abandons first (wandb's and MLflow's histories cannot be
    rewritten; TensorBoard's are the same records). None: resilience.snapshot_every +
    resilience.confirm_steps, which covers a rollback to the newest good snapshot; 0: send at
    once. Whatever is held is sent when the run ends or stops. At start."""
    mlflow_experiment: str = "bigtrain"
    """The MLflow experiment the run is logged under (created when missing); the MLflow run is
    named after the run directory and continued by a restarted run (RUN_DIR/mlflow_run_id)."""


def check_telemetry(profile: ProfileConfig, log: LogConfig) -> None:
    """profile.steps a window of two steps, counts in range, sinks known and not repeated."""
    steps = list(profile.steps)
    if steps and (len(steps) != 2 or not 1 <= steps[0] <= steps[1]):
        raise ConfigError(
            f"key 'profile.steps' got {steps}, expected [start, end] with 1 <= start <= end "
            "(or [] for off)"
        )
    if profile.warmup < 0:
        raise ConfigError(f"key 'profile.warmup' got {profile.warmup}, expected >= 0")
    if any(r < 0 for r in profile.ranks):
        raise ConfigError(f"key 'profile.ranks' got {list(profile.ranks)}, expected ranks >= 0")
    unknown = [s for s in log.sinks if s not in SINKS]
    if unknown or len(set(log.sinks)) != len(log.sinks):
        raise ConfigError(
            f"key 'log.sinks' got {list(log.sinks)}, expected distinct names of {list(SINKS)}"
        )
    if log.hold_steps is not None and log.hold_steps < 0:
        raise ConfigError(f"key 'log.hold_steps' got {log.hold_steps}, expected >= 0 or null")
    if not log.mlflow_experiment:
        raise ConfigError("key 'log.mlflow_experiment' is empty, expected an experiment name")
