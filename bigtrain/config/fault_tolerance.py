"""The `fault_tolerance.*` section: replica groups that fail and rejoin alone (torchft), and the
checks of its timeouts against each other and the hang watchdog (called by config/load.py's
`validate`). docs/fault-tolerance.md says why the timeouts nest."""

from __future__ import annotations

from dataclasses import dataclass

from bigtrain.errors import ConfigError

TRANSPORTS = ("http", "pg")


@dataclass
class FaultToleranceConfig:
    groups: int = 1
    """Replica groups: separate jobs (each its own torchrun or srun step, of any number of ranks
    with FSDP2/HSDP/tp inside) whose gradients are averaged over the groups alive at each step.
    A group that dies restarts alone and takes the whole state from a live peer; the others keep
    training. 1: off (a failure restarts the whole job from its checkpoint). Each group's
    process reads its index from BIGTRAIN_FT_GROUP (launch/ft.sh sets it)."""
    min_groups: int = 1
    """Groups that must take part in a step for it to be committed (applied); fewer: the step
    waits for the quorum to grow again, for up to quorum_timeout_s. A fresh job's first quorum
    waits for every group anyway (up to quorum_timeout_s)."""
    lighthouse: str = ""
    """The torchft lighthouse's address (http://host:port); empty: the TORCHFT_LIGHTHOUSE
    environment variable (launch/ft.sh and slurm/ft.sbatch start one and set it)."""
    heartbeat_timeout_s: float = 2.0
    """A group silent this long is dropped from the quorum (the lighthouse's setting: survivors
    of a failure stall about this long)."""
    join_timeout_s: float = 60.0
    """How much later than the first group a live group may ask for a step's quorum before the
    lighthouse forms it without that group (which then takes a peer's state at the next step:
    a `group_left` event with reason `late`). A group whose heartbeats stopped is left out after
    heartbeat_timeout_s whatever this is, so this bound costs a real failure nothing: keep it
    above the longest healthy lag between groups (a few step times, a leading group's
    synchronous checkpoint write); each group warns (`join_timeout_short` event) when 5 of its
    median steps exceed it. torchft's own default; below quorum_timeout_s."""
    quorum_timeout_s: float = 120.0
    """How long a group waits for a quorum: at start (a fresh job waits this long for all its
    groups), while peers start or transfer state."""
    timeout_s: float = 30.0
    """torchft's timeout for the collectives across groups, the commit vote and a state transfer
    (one group's whole state, over `transport`)."""
    slow_group_leaves_after: int = 0
    """What the groups do about a group that is persistently slower than the others (named the
    straggler by its own work's time, data and forward+backward, on monitor.timing_every steps;
    a `straggler` event with `scope: group`). 0: wait for it, the job runs at its pace. N: once
    named on N timing steps in a row, it leaves the job (a `group_left` event with reason
    `slow`; its processes exit 0, so their launcher does not start them again) and the others
    go on without it at their own pace, with its slice of each batch counted as skipped."""
    transport: str = "http"
    """How a rejoining group fetches the state from a live peer: `http` (torchft's HTTP server on
    each rank) or `pg` (a process group between the two ranks; needs numpy)."""


def hang_floor(parallel_timeout_s: float, hang_timeout_s: float | None) -> float:
    """The shortest step the hang watchdog may call a hang (callbacks/watchdog.py): its setting,
    or, automatic, parallel.timeout_s before step 20 and at least 300 s after."""
    return hang_timeout_s if hang_timeout_s is not None else min(parallel_timeout_s, 300.0)


def check_fault_tolerance(
    ft: FaultToleranceConfig, backend: str, parallel_timeout_s: float, hang_timeout_s: float | None
) -> None:
    """The section against itself, the backend and the timeouts that must contain its own."""
    if ft.groups < 1:
        raise ConfigError(
            f"key 'fault_tolerance.groups' got {ft.groups}, expected a positive integer"
        )
    if not 1 <= ft.min_groups <= ft.groups:
        raise ConfigError(
            f"key 'fault_tolerance.min_groups' got {ft.min_groups}, expected 1 <= value <= "
            f"fault_tolerance.groups ({ft.groups})"
        )
    if ft.transport not in TRANSPORTS:
        raise ConfigError(
            f"key 'fault_tolerance.transport' got {ft.transport!r}, expected one of "
            f"{list(TRANSPORTS)}"
        )
    if ft.slow_group_leaves_after < 0:
        raise ConfigError(
            f"key 'fault_tolerance.slow_group_leaves_after' got {ft.slow_group_leaves_after}, "
            "expected 0 (wait for a slow group) or a number of timing steps"
        )
    for key in ("heartbeat_timeout_s", "join_timeout_s", "quorum_timeout_s", "timeout_s"):
        if getattr(ft, key) <= 0:
            raise ConfigError(
                f"key 'fault_tolerance.{key}' got {getattr(ft, key)}, expected seconds > 0"
            )
    if ft.groups == 1:
        return
    if backend not in ("local", "fsdp"):
        raise ConfigError(
            f"key 'fault_tolerance.groups' is {ft.groups}, but parallel.backend is {backend!r}: "
            "replica groups need parallel.backend=fsdp (or local: groups of one process); "
            "DeepSpeed reduces the gradients and steps the optimizer inside its engine, so "
            "torchft cannot average them over the live groups or hold back an uncommitted "
            "step: ZeRO runs restart from checkpoints"
        )
    floor = hang_floor(parallel_timeout_s, hang_timeout_s)
    source = (
        "resilience.hang_timeout_s"
        if hang_timeout_s is not None
        else "the hang watchdog's automatic floor, min(parallel.timeout_s, 300),"
    )
    nested = [
        ("heartbeat_timeout_s", ft.heartbeat_timeout_s, "fault_tolerance.timeout_s", ft.timeout_s),
        ("timeout_s", ft.timeout_s, source, floor),
        ("quorum_timeout_s", ft.quorum_timeout_s, source, floor),
        (
            "join_timeout_s",
            ft.join_timeout_s,
            "fault_tolerance.quorum_timeout_s",
            ft.quorum_timeout_s,
        ),
        ("timeout_s", ft.timeout_s, "parallel.timeout_s", parallel_timeout_s),
    ]
    for key, value, outer, limit in nested:
        if value >= limit:
            raise ConfigError(
                f"key 'fault_tolerance.{key}' ({value:g} s) must be shorter than {outer} "
                f"({limit:g} s): timeouts nest (heartbeat < torchft's timeout < the hang "
                "watchdog; the lighthouse's join timeout < the groups' quorum timeout), or the "
                "outer one fires first and ends a group that torchft would have healed "
                "(docs/fault-tolerance.md)"
            )
