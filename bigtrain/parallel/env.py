"""Where this process sits: rank, world size, local rank, read from torchrun / deepspeed / SLURM."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from bigtrain.errors import ConfigError


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    launcher: str = "none"

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _int_env(name: str) -> int:
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r} is not an integer") from None


def read_env(local_rank_arg: int | None = None) -> DistEnv:
    """torchrun and the deepspeed launcher set RANK/WORLD_SIZE/LOCAL_RANK (deepspeed may pass
    --local_rank instead); `srun` sets SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        local = _int_env("LOCAL_RANK") if "LOCAL_RANK" in os.environ else (local_rank_arg or 0)
        launcher = "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else "env"
        return DistEnv(_int_env("RANK"), _int_env("WORLD_SIZE"), local, launcher)
    if "SLURM_PROCID" in os.environ and "SLURM_NTASKS" in os.environ:
        return DistEnv(
            _int_env("SLURM_PROCID"),
            _int_env("SLURM_NTASKS"),
            _int_env("SLURM_LOCALID") if "SLURM_LOCALID" in os.environ else 0,
            "slurm",
        )
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
