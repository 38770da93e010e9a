"""Where this process sits: rank, world size, local rank, from torchrun / deepspeed / SLURM; and the
process group."""

from __future__ import annotations

import datetime
import logging
import os
import socket
import subprocess
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from bigtrain.errors import ConfigError

USED_PROCESS_GROUP = False  # set once this process initialised a process group


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    launcher: str = "none"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 or dist.is_initialized()


def _int_env(name: str) -> int:
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r} is not an integer") from None


def slurm_master_addr(nodelist: str) -> str:
    """First host of a SLURM node list (`node[01-04]` and friends), expanded by scontrol."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ConfigError(
            f"SLURM_JOB_NODELIST={nodelist!r}: cannot expand it with scontrol ({e})"
        ) from None
    hosts = out.stdout.split()
    if out.returncode != 0 or not hosts:
        raise ConfigError(
            f"SLURM_JOB_NODELIST={nodelist!r}: scontrol show hostnames failed: {out.stderr.strip()}"
        )
    return hosts[0]


def read_env(local_rank_arg: int | None = None) -> DistEnv:
    """torchrun and the deepspeed launcher set RANK/WORLD_SIZE/LOCAL_RANK (deepspeed may pass
    --local_rank instead); `srun` sets SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID. Under SLURM the
    rendezvous variables are derived here so that torch.distributed and DeepSpeed find them."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        local = _int_env("LOCAL_RANK") if "LOCAL_RANK" in os.environ else (local_rank_arg or 0)
        launcher = "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else "env"
        return DistEnv(_int_env("RANK"), _int_env("WORLD_SIZE"), local, launcher)
    if "SLURM_PROCID" in os.environ and "SLURM_NTASKS" in os.environ:
        env = DistEnv(
            _int_env("SLURM_PROCID"),
            _int_env("SLURM_NTASKS"),
            _int_env("SLURM_LOCALID") if "SLURM_LOCALID" in os.environ else 0,
            "slurm",
        )
        if env.world_size > 1:
            if "MASTER_ADDR" not in os.environ:
                # the job step's first node (a replica group's step may run on any of the job's)
                nodes = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get(
                    "SLURM_JOB_NODELIST", "localhost"
                )
                os.environ["MASTER_ADDR"] = slurm_master_addr(nodes)
            # A port per job, so that two jobs sharing a node do not collide.
            os.environ.setdefault(
                "MASTER_PORT", str(20000 + int(os.environ.get("SLURM_JOB_ID", "0")) % 20000)
            )
            os.environ.update(
                RANK=str(env.rank), WORLD_SIZE=str(env.world_size), LOCAL_RANK=str(env.local_rank)
            )
        return env
    return DistEnv(0, 1, local_rank_arg or 0, "none")


def pick_device(choice: str, env: DistEnv) -> torch.device:
    """One device per local rank on CUDA; the CPU otherwise."""
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("train.device=cuda but no CUDA device is visible")
        device = torch.device("cuda", env.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_process_group(
    env: DistEnv, device: torch.device, timeout_s: float, required: bool
) -> None:
    """NCCL on CUDA, gloo on CPU, with a timeout so that a lost rank cannot hang the others forever.
    `required`: the backend needs a group even in one process (FSDP2, DeepSpeed)."""
    if dist.is_initialized() or (env.world_size == 1 and not required):
        return
    if env.world_size == 1:  # a group of one, for sharded backends run without a launcher
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK=str(env.local_rank))
    for var in ("MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            raise ConfigError(
                f"{env.world_size} processes but {var} is not set (launch with torchrun, deepspeed or srun)"
            )
    backend = "nccl" if device.type == "cuda" else "gloo"
    global USED_PROCESS_GROUP
    USED_PROCESS_GROUP = True
    timeout = datetime.timedelta(seconds=timeout_s)
    store = None
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's agent keeps one store across restarts: without a per-attempt prefix the
        # restarted workers read the dead workers' gloo/NCCL addresses and cannot connect.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        client = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            env.world_size,
            is_master=False,
            timeout=timeout,
        )
        store = dist.PrefixStore(f"bigtrain/attempt{attempt}", client)
    dist.init_process_group(
        backend,
        store=store,
        rank=env.rank,
        world_size=env.world_size,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )


def shutdown(clean: bool) -> None:
    """Destroy the process groups. `clean`: every rank got here without an error, so a barrier
    first makes sure no rank tears down its group while another is still in a collective (after an
    error the others may never arrive; the barrier would only wait for the timeout)."""
    if dist.is_initialized():
        if clean:
            dist.barrier()
        dist.destroy_process_group()


def hard_exit_after_distributed(code: int) -> None:
    """End a process that ran a process group with os._exit once everything is flushed.

    Interpreter teardown after destroy_process_group can still abort in C++ static destructors
    ("terminate called without an active exception", seen once in CI under the deepspeed launcher
    with gloo after a finished run): the launcher then reports a crash for a run that completed.
    Files, events and wandb are closed before this point, so skipping the teardown loses nothing."""
    if not USED_PROCESS_GROUP:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)
