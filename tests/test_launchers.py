"""End to end through the real launchers: torchrun (fsdp) and the deepspeed launcher (zero), 2 CPU
processes each, on configs/tiny.yaml for a few steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bigtrain.parallel.env import free_port
from bigtrain.store.rundir import read_jsonl
from tests.conftest import ROOT
from tests.distributed import run_distributed, train_run

TORCHRUN_2 = ("torchrun", "--nproc-per-node", "2", "--master-port")


def launch(cmd: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def tiny(out, cache_dir, backend: str) -> list[str]:
    return [
        "configs/tiny.yaml",
        f"train.out_dir={out}",
        f"data.cache_dir={cache_dir}",
        f"parallel.backend={backend}",
        "train.max_steps=6",
        "train.micro_batch_size=8",
        "train.eval_every=3",
        "checkpoint.every=3",
        "wandb.mode=disabled",
    ]


def check_run(out, world_size: int) -> None:
    final = json.loads((out / "final.json").read_text())
    assert final["step"] == 6 and final["tokens"] == 6 * 16 * 128
    start = read_jsonl(out / "events.jsonl")[0]
    assert start["world_size"] == world_size and start["global_batch_size"] == 16
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "step_00000003",
        "step_00000006",
    ]


@pytest.mark.distributed
def test_torchrun_fsdp_and_an_elastic_restart_after_a_killed_rank(tmp_path, cache_dir):
    """A 2-rank torchrun run with rank 1 SIGKILLed after step 5 under `--max-restarts 1`: every
    worker restarts, resumes from the newest committed checkpoint, and ends with the weights of
    the same run never stopped (2 ranks forked from the test's server: the reference, not what
    is under test) bit for bit (nothing was skipped)."""
    out = tmp_path / "fsdp"
    config, *overrides = tiny(out, cache_dir, "fsdp")
    run_distributed(train_run, 2, overrides, (config,))
    check_run(out, 2)

    killed = tmp_path / "killed"
    result = launch(
        [
            *TORCHRUN_2,
            str(free_port()),
            "--max-restarts",
            "1",
            "-m",
            "bigtrain",
            "train",
            *tiny(killed, cache_dir, "fsdp"),
            "drill.rank=1",
            "drill.kill_step=5",
            # step 3's checkpoint committed before the kill: an async write still in flight on a
            # loaded machine would leave nothing to resume (the run restarts from scratch)
            "checkpoint.async_save=false",
        ]
    )
    assert result.returncode == 0, result.stderr[-3000:]
    check_run(killed, 2)
    final = json.loads((killed / "final.json").read_text())
    assert final["fingerprint"] == json.loads((out / "final.json").read_text())["fingerprint"]
    resume = [e for e in read_jsonl(killed / "events.jsonl") if e["kind"] == "resume"]
    assert len(resume) == 1 and resume[0]["torchelastic_restart_count"] == 1
    assert resume[0]["path"].endswith("step_00000003")


@pytest.mark.distributed
def test_deepspeed_launcher_zero(tmp_path, cache_dir):
    out = tmp_path / "zero"
    result = launch(
        [
            "deepspeed",
            "--num_gpus",
            "2",
            "--master_port",
            str(free_port()),
            "--module",
            "bigtrain",
            "train",
            *tiny(out, cache_dir, "zero"),
        ]
    )
    assert result.returncode == 0, result.stderr[-3000:]
    check_run(out, 2)


@pytest.mark.e2e
def test_launch_scripts_have_help():
    for script in ("launch/torchrun.sh", "launch/deepspeed.sh", "launch/local-slurm.sh"):
        result = subprocess.run(
            ["bash", script, "--help"], cwd=ROOT, capture_output=True, text=True
        )
        assert (
            result.returncode == 0
            and "Variables" in result.stdout
            and "set -euo" not in result.stdout
        )


@pytest.mark.distributed
def test_local_backend_refuses_several_processes(tmp_path, cache_dir):
    result = launch(
        [
            *TORCHRUN_2,
            str(free_port()),
            "-m",
            "bigtrain",
            "train",
            *tiny(tmp_path / "x", cache_dir, "local"),
        ]
    )
    assert result.returncode != 0
    message = "parallel.backend=local runs one process, but the launcher started 2"
    assert result.stderr.count(message) == 1  # every rank finds it: rank 0 says it


@pytest.mark.distributed
def test_a_one_process_run_moves_to_two_ranks_keeping_its_global_batch(tmp_path, cache_dir):
    """The documented way to move a run: stopped on one process, the same command under torchrun
    with parallel.backend=fsdp. Neither run sets train.global_batch_size; the checkpoint's batch
    of 8 sequences is kept at 2 ranks (micro-batch 8 -> 4), said once, and the run ends."""
    out = tmp_path / "moved"
    first = [*tiny(out, cache_dir, "local"), "train.stop_at_step=3"]
    result = launch([sys.executable, "-m", "bigtrain", "train", *first])
    assert result.returncode == 0, result.stderr[-3000:]
    args = tiny(out, cache_dir, "fsdp")
    result = launch([*TORCHRUN_2, str(free_port()), "-m", "bigtrain", "train", *args])
    assert result.returncode == 0, result.stderr[-3000:]
    note = (
        "global batch kept at 8 sequences on 2 data-parallel ranks: train.micro_batch_size "
        "8 -> 4 (this config gives 16 here)"
    )
    assert (result.stdout + result.stderr).count(note) == 1
    (resume,) = [e for e in read_jsonl(out / "events.jsonl") if e["kind"] == "resume"]
    assert resume["batch"] == note and resume["identity_changed"] == []
    final = json.loads((out / "final.json").read_text())
    assert final["step"] == 6 and final["tokens"] == 6 * 8 * 128


@pytest.mark.e2e
def test_ft_launcher_has_help_and_refuses_a_missing_group_count():
    shown = subprocess.run(
        ["bash", "launch/ft.sh", "--help"], cwd=ROOT, capture_output=True, text=True
    )
    assert shown.returncode == 0 and "--nproc-per-group" in shown.stdout
    assert "set -uo" not in shown.stdout
    bare = subprocess.run(
        ["bash", "launch/ft.sh", "configs/tiny.yaml"], cwd=ROOT, capture_output=True, text=True
    )
    assert bare.returncode == 2 and "usage: bash launch/ft.sh --groups G" in bare.stderr


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--groups"], "launch/ft.sh: --groups needs a value (usage: bash launch/ft.sh"),
        (["--groups", "2", "--port"], "launch/ft.sh: --port needs a value"),
        (
            ["--groups", "2", "--port", "99999", "configs/tiny.yaml"],
            "launch/ft.sh: --port got '99999', expected a TCP port 0..65535 (0: any free one)",
        ),
        (
            ["--groups", "2", "--nproc-per-group", "0", "configs/tiny.yaml"],
            "launch/ft.sh: --nproc-per-group got '0', expected a number of ranks per group >= 1",
        ),
        (
            ["--groups", "1", "configs/tiny.yaml"],
            "launch/ft.sh: --groups got '1', expected a number of replica groups >= 2",
        ),
        (["--groups", "two", "configs/tiny.yaml"], "launch/ft.sh: --groups got 'two'"),
        (
            ["--groups", "2", "--max-restarts", "-1", "configs/tiny.yaml"],
            "launch/ft.sh: --max-restarts got '-1', expected a number of restarts per group >= 0",
        ),
        (["--groups", "2", "--port", "1e3", "configs/tiny.yaml"], "launch/ft.sh: --port got '1e3'"),
        (["--gruops", "2", "configs/tiny.yaml"], "launch/ft.sh: unknown option '--gruops'"),
    ],
)
def test_ft_launcher_refuses_bad_options_before_starting_anything(tmp_path, args, message):
    """One line, exit 2, and neither the lighthouse nor a group started (no log directory)."""
    logs = tmp_path / "logs"
    result = subprocess.run(
        ["bash", "launch/ft.sh", *args],
        cwd=ROOT,
        env={**os.environ, "FT_LOG_DIR": str(logs)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(message) and result.stderr.count("\n") == 1, result.stderr
    assert not logs.exists()


@pytest.mark.e2e
def test_ft_launcher_shows_a_config_error_as_its_one_line(tmp_path):
    """The lighthouse reads the config first: its one line is what the launcher shows."""
    result = subprocess.run(
        ["bash", "launch/ft.sh", "--groups", "3", "configs/tiny.yaml", "drill.kill_group=5"],
        cwd=ROOT,
        env={**os.environ, "FT_LOG_DIR": str(tmp_path / "logs")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr == (
        "bigtrain: error: key 'drill.kill_group' got 5, expected -1 (off) or a replica group "
        "0..2 (fault_tolerance.groups is 3)\n"
    )
    assert not (tmp_path / "logs" / "group0.log").exists()


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"FT_GROUPS": "1"}, "bigtrain-ft: FT_GROUPS got '1', expected a number of replica groups"),
        ({"FT_GROUPS": "x"}, "bigtrain-ft: FT_GROUPS got 'x'"),
        ({"FT_NPROC_PER_GROUP": "0"}, "bigtrain-ft: FT_NPROC_PER_GROUP got '0', expected"),
        ({"FT_GROUP_RESTARTS": "-1"}, "bigtrain-ft: FT_GROUP_RESTARTS got '-1', expected"),
        (
            {"FT_GROUPS": "2", "FT_NPROC_PER_GROUP": "2", "SLURM_NTASKS": "2"},
            "bigtrain-ft: FT_GROUPS x FT_NPROC_PER_GROUP = 4 tasks, but the allocation has 2",
        ),
    ],
)
def test_ft_sbatch_refuses_bad_settings_before_starting_anything(tmp_path, env, message):
    out = tmp_path / "out"
    result = subprocess.run(
        ["bash", "slurm/ft.sbatch"],
        cwd=ROOT,
        env={**os.environ, "OUT_DIR": str(out), "SLURM_JOB_NAME": "t", **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(message) and result.stderr.count("\n") == 1, result.stderr
    assert not out.exists()  # no lighthouse, no job step


@pytest.mark.distributed
def test_torchrun_launcher_passes_the_workers_exit_code_through(tmp_path):
    """torchrun itself exits 1 with its own traceback for any failed worker; launch/torchrun.sh
    exits 2 for a bad config key, with bigtrain's one line and none of torchrun's traceback."""
    env = {
        **os.environ,
        "NPROC_PER_NODE": "1",
        "RDZV_ENDPOINT": f"localhost:{free_port()}",
        "OMP_NUM_THREADS": "1",
    }
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    result = subprocess.run(
        [
            "bash",
            "launch/torchrun.sh",
            "configs/tiny.yaml",
            f"train.out_dir={tmp_path}",
            "trian.seed=1",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.splitlines()
    assert "bigtrain: error: unknown config key 'trian.seed' (did you mean 'train.seed'?)" in lines
    assert lines[-1].startswith("launch/torchrun.sh: rank 0 failed first (exit code 2: bad config")
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr
