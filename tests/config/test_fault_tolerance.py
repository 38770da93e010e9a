"""The fault_tolerance section's checks: each bad setting exits 2 naming its key."""

import pytest

from bigtrain.config import load_config
from bigtrain.errors import ConfigError
from tests.conftest import run_cli

FT = ["parallel.backend=fsdp", "fault_tolerance.groups=3"]


@pytest.mark.unit
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallel.backend=zero"], "parallel.backend is 'zero': replica groups need"),
        (["fault_tolerance.min_groups=4"], "'fault_tolerance.min_groups' got 4, expected 1 <="),
        (["fault_tolerance.min_groups=0"], "'fault_tolerance.min_groups' got 0"),
        (["fault_tolerance.transport=nccl"], "'fault_tolerance.transport' got 'nccl'"),
        (["fault_tolerance.timeout_s=0"], "'fault_tolerance.timeout_s' got 0"),
        (
            ["resilience.hang_timeout_s=20"],
            "'fault_tolerance.timeout_s' (30 s) must be shorter than resilience.hang_timeout_s",
        ),
        (
            ["fault_tolerance.quorum_timeout_s=400"],
            "'fault_tolerance.quorum_timeout_s' (400 s) must be shorter than the hang watchdog's "
            "automatic floor, min(parallel.timeout_s, 300), (300 s)",
        ),
        (
            ["fault_tolerance.heartbeat_timeout_s=40"],
            "'fault_tolerance.heartbeat_timeout_s' (40 s) must be shorter than "
            "fault_tolerance.timeout_s",
        ),
        (
            ["parallel.timeout_s=20", "fault_tolerance.quorum_timeout_s=10"],
            "'fault_tolerance.timeout_s' (30 s) must be shorter than the hang watchdog's "
            "automatic floor, min(parallel.timeout_s, 300), (20 s)",
        ),
    ],
)
def test_bad_fault_tolerance_settings_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as error:
        load_config([], FT + overrides)
    assert message in str(error.value)


@pytest.mark.unit
def test_one_group_is_off_and_skips_the_group_checks():
    cfg = load_config([], ["parallel.backend=zero", "resilience.hang_timeout_s=5"])
    assert cfg.fault_tolerance.groups == 1


@pytest.mark.unit
def test_nested_timeouts_pass():
    cfg = load_config([], FT + ["resilience.hang_timeout_s=200"])
    assert cfg.fault_tolerance.quorum_timeout_s < 200


@pytest.mark.e2e
def test_a_group_process_without_its_index_exits_2_naming_the_variable(tmp_path):
    result = run_cli(
        "train",
        "configs/tiny.yaml",
        *FT,
        f"train.out_dir={tmp_path / 'run'}",
        env={"BIGTRAIN_FT_GROUP": "7"},
    )
    assert result.returncode == 2, result.stderr
    assert "BIGTRAIN_FT_GROUP set to its replica group (0..2), got '7'" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.e2e
def test_an_unreachable_lighthouse_exits_2_at_once_naming_it(tmp_path):
    """A wrong lighthouse address fails before the data and the model are built (it used to be
    torchft's traceback after its retries, 41 s), and leaves no run directory."""
    from bigtrain.parallel.env import free_port

    address = f"http://127.0.0.1:{free_port()}"
    result = run_cli(
        "train",
        "configs/tiny.yaml",
        *FT,
        f"train.out_dir={tmp_path / 'run'}",
        env={"BIGTRAIN_FT_GROUP": "0", "TORCHFT_LIGHTHOUSE": address},
    )
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith(f"bigtrain: error: the torchft lighthouse {address} "), lines
    assert "(TORCHFT_LIGHTHOUSE) cannot be reached" in lines[-1]
    assert "Traceback" not in result.stderr and not (tmp_path / "run").exists()
