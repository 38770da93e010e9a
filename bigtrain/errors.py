"""Errors that end a run with a documented exit code (README, Exit codes)."""


class ConfigError(ValueError):
    """A user's config, input file or checkpoint is wrong. The CLI prints the message (which names
    the key or file and what was expected) without a traceback and exits 2."""

    exit_code = 2


class SharedConfigError(ConfigError):
    """A config error that every rank finds alike (the config's keys, the layout's sizes, a
    resumed checkpoint's identity and batch): the CLI prints it once, on rank 0."""


class AbortRun(RuntimeError):
    """The run gave up after anomalies; the last good checkpoint is intact. Exit 3."""

    exit_code = 3


class Preempted(RuntimeError):
    """A preemption signal (SIGTERM, SIGUSR1) arrived; every rank checkpointed at the same step
    boundary. Exit 4: requeue me."""

    exit_code = 4


class HostExcluded(RuntimeError):
    """Transient faults kept coming from one host (resilience.max_transient_per_rank): its name is
    in RUN_DIR/excluded_hosts.txt. Exit 6: requeue without it."""

    exit_code = 6


class ReplicaMismatch(RuntimeError):
    """Ranks ended with different weights where they must agree: a bug or silent corruption."""

    exit_code = 7


class GroupLeft(RuntimeError):
    """This replica group left the job as the straggler (fault_tolerance.slow_group_leaves_after):
    the others go on without it. Exit 0, so that its launcher does not start it again."""

    exit_code = 0


HANG_EXIT_CODE = 5  # the hang watchdog (callbacks/watchdog.py) ends the process with os._exit


class OutOfMemory(RuntimeError):
    """A rank ran out of device memory: its `oom` event holds the bytes in use and `bigtrain
    plan`'s prediction for the config; on CUDA the allocator's snapshot is under RUN_DIR/memory/.
    Exit 8 (the same config fails the same way: change it before a retry)."""

    exit_code = 8
