import os
import stat

import pytest

from bigtrain.errors import ConfigError
from bigtrain.parallel.env import read_env

pytestmark = pytest.mark.unit

LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_JOB_NODELIST",
    "SLURM_JOB_ID",
)


@pytest.fixture
def clean_env(monkeypatch):
    saved = dict(os.environ)  # read_env writes rendezvous variables for SLURM: undo them all
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    yield monkeypatch
    os.environ.clear()
    os.environ.update(saved)


def test_single_process_defaults(clean_env):
    env = read_env()
    assert (env.rank, env.world_size, env.local_rank, env.launcher) == (0, 1, 0, "none")
    assert read_env(local_rank_arg=3).local_rank == 3  # deepspeed's --local_rank


def test_torchrun_variables(clean_env):
    clean_env.setenv("RANK", "3")
    clean_env.setenv("WORLD_SIZE", "4")
    clean_env.setenv("LOCAL_RANK", "1")
    clean_env.setenv("TORCHELASTIC_RUN_ID", "x")
    env = read_env()
    assert (env.rank, env.world_size, env.local_rank, env.launcher) == (3, 4, 1, "torchrun")


def test_bad_rank_variable_is_a_config_error(clean_env):
    clean_env.setenv("RANK", "one")
    clean_env.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="RANK='one' is not an integer"):
        read_env()


def test_slurm_variables_and_master_from_scontrol(clean_env, tmp_path):
    # scontrol's expansion of a node list, as a stand-in program on PATH (the real one runs in the
    # SLURM end-to-end tests)
    fake = tmp_path / "scontrol"
    fake.write_text(
        '#!/bin/sh\n[ "$1 $2 $3" = "show hostnames node[07-08]" ] && printf "node07\\nnode08\\n"\n'
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    clean_env.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    for var, value in {
        "SLURM_PROCID": "1",
        "SLURM_NTASKS": "2",
        "SLURM_LOCALID": "0",
        "SLURM_JOB_NODELIST": "node[07-08]",
        "SLURM_JOB_ID": "1234",
    }.items():
        clean_env.setenv(var, value)
    env = read_env()
    assert (env.rank, env.world_size, env.local_rank, env.launcher) == (1, 2, 0, "slurm")
    assert os.environ["MASTER_ADDR"] == "node07"
    assert os.environ["MASTER_PORT"] == str(20000 + 1234)
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == ("1", "2")
