"""The inputs of `bigtrain plan --goodput`, each with where its value came from.

Every input has a default (the Llama 3 report's failure rates, public figures for the costs, or
the config's own cadence), may be replaced by a cost measured in a run directory (`--from`,
telemetry/costs.py), and may be set by the user (`--set key=value`, last). Costs are kept in
units that carry over from the run that measured them to the planned scale: bandwidths (applied
to the planned checkpoint size per GPU), steps, and fixed seconds.

Failure rates per GPU-hour from the Llama 3 report (Dubey et al. 2024, section 3.3.4, table 5):
466 job interruptions in 54 days on 16,384 H100 GPUs (21.2M GPU-hours), 47 planned and 419
unexpected. Of the unexpected ones, 7 were NCCL watchdog timeouts (hangs) and 6 silent data
corruption (numeric: what a NaN/spike rollback catches); the other 406 (faulty GPUs 148, HBM3 72,
software bugs 54, network 35, host maintenance 32, SRAM 19, GPU system processor 17, NICs 7, ...)
killed the job. The report lists no fault that a replay would absorb: transient defaults to 0.

With fault-tolerant replica groups (`replica_groups` > 1) the hardware failures restart only their
group (simulation.py); each group holds the whole state over 1/replica_groups of the GPUs, so its
bytes per GPU (its checkpoint's, a restart's load, a snapshot's, a peer's transfer) are
replica_groups times the whole job's sharded ones.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass, field

from bigtrain.errors import ConfigError
from bigtrain.plan.simulation import KINDS, SimParams

LLAMA3_GPU_HOURS = 16_384 * 54 * 24
LLAMA3_COUNTS = {"hardware": 406, "numeric": 6, "transient": 0, "hang": 7, "preemption": 47}
LLAMA3_RATES = {kind: n / LLAMA3_GPU_HOURS for kind, n in LLAMA3_COUNTS.items()}
GB = 1e9


@dataclass(frozen=True)
class GoodputInputs:
    gpus: int
    """GPUs of the planned run (--gpus)."""
    days: float = 54.0
    """Wall-clock length of each simulated run (Llama 3's 54-day window)."""
    gpus_per_node: int = 8
    step_s: float = 5.0
    """Seconds of one optimizer step at the planned scale."""
    ckpt_gb_per_gpu: float = 1.0
    """Checkpoint bytes per GPU (GB): master weights and optimizer states, sharded."""
    save_gbps_per_node: float = 2000 / 2048
    """Checkpoint write bandwidth per node (GB/s). Default: Llama 3's storage sustained 2 TB/s,
    shared by 2,048 nodes."""
    load_gbps_per_node: float = 2000 / 2048
    """Checkpoint read bandwidth per node on a restart (GB/s), as the write."""
    stall_gbps: float = 0.57
    """Per GPU (GB/s): the blocking part of an asynchronous save. Default: PyTorch DCP's
    process-based async save blocked a 70B run on 1,856 H200s for 0.78 s, 446 MB per GPU."""
    stall_fixed_s: float = 0.0
    """Seconds every save stalls whatever its size (planning, collectives, the commit's
    barrier); none assumed by default; measured from a run whose checkpoint is small."""
    write_fixed_s: float = 0.0
    """Seconds every background write takes whatever its size (fsync, hashing, the manifest)."""
    snapshot_gbps: float = 20.0
    """Per GPU (GB/s): an in-memory snapshot's device-to-host copy (PCIe Gen5 x16 into pinned
    memory, about a third of its 64 GB/s: assumed)."""
    restore_gbps: float = 20.0
    """Per GPU (GB/s): a rollback putting a snapshot back (host to device; assumed)."""
    restart_s: float = 600.0
    """A job restart up to its first step, the checkpoint load aside. Default: about 10 minutes
    per failure (Meta's figure before fault-tolerant HSDP cut it to about 3)."""
    hang_timeout_s: float = 300.0
    """bigtrain's watchdog: resilience.hang_timeout_s, or max(300 s, 10 x the step time)."""
    plain_hang_timeout_s: float = 600.0
    """Without the watchdog a hang ends at the collective timeout (NCCL's default: 10 min)."""
    replay_steps: float = 1.0
    """Steps of time one replay costs (it runs the step's micro-batches once more)."""
    suspicions_per_1k: float = 0.83
    """Healthy steps per 1,000 that the suspicion tier replays (monitor.suspicion; 0 when off).
    Default: bench/detection.py --quick's measured rate on the micro model."""
    ckpt_every_steps: int = 250
    snapshot_every: int = 25
    confirm_steps: int = 10
    async_save: bool = True
    replica_groups: int = 1
    """Fault-tolerant replica groups (fault_tolerance.groups); 1: none."""
    ft_restart_s: float = 180.0
    """A replica group's restart up to its quorum request (process start, bigtrain's start-up).
    Default: Meta's about 3 minutes per failure with fault-tolerant HSDP (as restart_s)."""
    ft_transfer_gbps: float = 1.8
    """Per GPU (GB/s): a rejoining group's state from a live peer. Default: torchft's HTTP
    transport fetched 12 GB in 6.6 s with its default of no parallel chunks (torchft PR #106;
    3.0 s with 10 chunks): Python's serialization, not the network, is the bound."""
    ft_stall_s: float = 2.0
    """What a group's failure stalls the others, the failed step aside: the lighthouse's
    heartbeat timeout (fault_tolerance.heartbeat_timeout_s)."""
    rates: dict[str, float] = field(default_factory=lambda: dict(LLAMA3_RATES))
    """Failures per GPU-hour by kind (KINDS)."""

    def sim_params(self, ft: bool = False) -> SimParams:
        """The simulation's seconds: checkpoint bytes over the bandwidths, rates for the job;
        `ft`: with the replica groups (each holds the whole state: `replica_groups` times the
        bytes per GPU)."""
        groups = self.replica_groups if ft else 1
        per_gpu = self.ckpt_gb_per_gpu * GB * groups
        per_node = per_gpu * self.gpus_per_node
        write_s = self.write_fixed_s + per_node / (self.save_gbps_per_node * GB)
        load_s = per_node / (self.load_gbps_per_node * GB)
        snapshot_s = per_gpu / (self.snapshot_gbps * GB) if self.snapshot_every else 0.0
        return SimParams(
            horizon_s=self.days * 86400,
            rates={k: r * self.gpus / 3600 for k, r in self.rates.items()},
            step_s=self.step_s,
            stall_s=self.stall_fixed_s + per_gpu / (self.stall_gbps * GB)
            if self.async_save
            else write_s,
            write_s=write_s,
            async_save=self.async_save,
            restart_s=self.restart_s + load_s,
            hang_timeout_s=self.hang_timeout_s,
            plain_hang_timeout_s=self.plain_hang_timeout_s,
            snapshot_overhead=snapshot_s / (self.snapshot_every * self.step_s)
            if self.snapshot_every
            else 0.0,
            snapshot_work_s=self.snapshot_every * self.step_s,
            confirm_work_s=self.confirm_steps * self.step_s,
            restore_s=per_gpu / (self.restore_gbps * GB) if self.snapshot_every else load_s,
            replay_s=self.replay_steps * self.step_s,
            suspicion_overhead=self.suspicions_per_1k / 1000 * self.replay_steps,
            save_s=write_s,
            groups=groups,
            group_restart_s=self.ft_restart_s + per_gpu / (self.ft_transfer_gbps * GB),
            survivor_stall_s=self.ft_stall_s + self.step_s,
        )

    def mtbf_s(self, healing: bool, ft: bool = False) -> float:
        """Mean time between the failures that restart the job (inf: none); with replica groups
        a hardware failure restarts only its group."""
        alone = ("numeric", "transient") if healing else ()
        alone += ("hardware",) if ft and self.replica_groups > 1 else ()
        kinds = [k for k in KINDS if k not in alone]
        rate = sum(self.rates.get(k, 0.0) for k in kinds) * self.gpus / 3600
        return 1 / rate if rate > 0 else math.inf


SCALARS = {f.name: f for f in dataclasses.fields(GoodputInputs) if f.name not in ("rates", "gpus")}
POSITIVE = {
    "days",
    "gpus_per_node",
    "step_s",
    "ckpt_every_steps",
    "replica_groups",
    *(k for k in SCALARS if k.endswith("gbps")),
}
KEYS = sorted([*SCALARS, *(f"rate.{k}" for k in KINDS)])


SHORT = {
    "async_save": "checkpoint.async_save",
    "ckpt_every_steps": "checkpoint.every (steps)",
    "ckpt_gb_per_gpu": "checkpoint GB per GPU",
    "confirm_steps": "resilience.confirm_steps",
    "days": "wall days per simulated run",
    "gpus_per_node": "GPUs per node",
    "ft_restart_s": "a replica group's restart (s)",
    "ft_stall_s": "survivors' stall, step aside (s)",
    "ft_transfer_gbps": "peer state transfer GB/s per GPU",
    "hang_timeout_s": "hang detection, healing (s)",
    "load_gbps_per_node": "checkpoint read GB/s per node",
    "plain_hang_timeout_s": "hang detection, plain (s)",
    "replay_steps": "steps one replay costs",
    "suspicions_per_1k": "suspicion replays per 1000 steps",
    "replica_groups": "fault_tolerance.groups",
    "restart_s": "restart to first step (s)",
    "restore_gbps": "snapshot restore GB/s per GPU",
    "save_gbps_per_node": "checkpoint write GB/s per node",
    "snapshot_every": "resilience.snapshot_every",
    "snapshot_gbps": "snapshot copy GB/s per GPU",
    "stall_gbps": "async save's blocking GB/s/GPU",
    "stall_fixed_s": "async save's fixed stall (s)",
    "write_fixed_s": "checkpoint write's fixed time (s)",
    "step_s": "step time (s)",
}


def doc(key: str) -> str:
    """A short description of an input (the printed table)."""
    return "failures per GPU-hour" if key.startswith("rate.") else SHORT[key]


def parse_value(key: str, text: str) -> float | int | bool:
    """`text` as the type of input `key`; ConfigError naming the key for a bad value."""
    if key.startswith("rate."):
        kind = key.removeprefix("rate.")
        if kind not in KINDS:
            raise ConfigError(
                f"--set {key}: unknown failure kind '{kind}', expected one of {', '.join(KINDS)}"
            )
        kind_type: type = float
    elif key in SCALARS:  # annotations are strings here (from __future__ import annotations)
        kind_type = {"int": int, "float": float, "bool": bool}[str(SCALARS[key].type)]
    else:
        close = difflib.get_close_matches(key, KEYS, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(
            f"--set {key}: unknown goodput input{hint}; the inputs are {', '.join(KEYS)}"
        )
    try:
        if kind_type is bool:
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError(text)
            return text.lower() in ("true", "1")
        value = kind_type(float(text)) if kind_type is int else kind_type(text)
    except ValueError:
        raise ConfigError(f"--set {key}={text}: expected a {kind_type.__name__}") from None
    check_value(key, value)
    return value


def check_value(key: str, value: float) -> None:
    if isinstance(value, bool):
        return
    if not math.isfinite(value) or value < 0 or (key in POSITIVE and value == 0):
        expected = "a positive number" if key in POSITIVE else "a number >= 0"
        raise ConfigError(f"goodput input '{key}' got {value}, expected {expected}")


class Sourced:
    """Inputs being assembled, each value with its source (default, config, measured, user)."""

    def __init__(self, gpus: int) -> None:
        self.values: dict[str, object] = {k: getattr(GoodputInputs(gpus), k) for k in SCALARS} | {
            f"rate.{k}": LLAMA3_RATES[k] for k in KINDS
        }
        self.sources = dict.fromkeys(self.values, "default")
        for kind in KINDS:
            self.sources[f"rate.{kind}"] = (
                f"Llama 3: {LLAMA3_COUNTS[kind]} in 54 days on 16,384 GPUs"
            )
        self.gpus = gpus
        self.notes: list[str] = []
        """What the plan says beside its inputs: measurements not used, and why."""

    def set(self, key: str, value: object, source: str) -> None:
        assert key in self.values, key
        if not isinstance(value, bool):
            check_value(key, float(value))  # type: ignore[arg-type]
        self.values[key], self.sources[key] = value, source

    def override(self, items: list[str]) -> None:
        """`--set key=value` items, in order."""
        for item in items:
            key, sep, text = item.partition("=")
            if not sep:
                raise ConfigError(f"--set {item}: expected key=value")
            self.set(key.strip(), parse_value(key.strip(), text.strip()), "user (--set)")

    def inputs(self) -> GoodputInputs:
        scalars = {k: v for k, v in self.values.items() if not k.startswith("rate.")}
        rates = {k: float(self.values[f"rate.{k}"]) for k in KINDS}  # type: ignore[arg-type]
        return GoodputInputs(gpus=self.gpus, rates=rates, **scalars)  # type: ignore[arg-type]
