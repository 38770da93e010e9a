"""The fsdp backend's mesh: its shape from the config and the world size, and its checks."""

from __future__ import annotations

import pytest

from bigtrain.config import load_config
from bigtrain.errors import ConfigError
from bigtrain.parallel.mesh import mesh_shape
from tests.conftest import run_cli

HF = "model.kind=hf"
LLAMA = "model.hf_config={model_type: llama}"
PLAN = "parallel.tp_plan={q_proj: colwise, o_proj: rowwise}"


def parallel(*overrides: str):
    return load_config([], ["parallel.backend=fsdp", *overrides]).parallel


@pytest.mark.unit
def test_replicate_splits_the_world_into_replicas_of_a_shard_group():
    shape = mesh_shape(parallel("parallel.replicate=2"), 8)
    assert (shape.replicate, shape.shard) == (2, 4)
    assert shape.axes == ("replicate", "shard") and shape.sizes == (2, 4)
    assert shape.describe() == "replicate 2 x shard 4"


@pytest.mark.unit
def test_without_replicas_the_mesh_is_one_shard_axis():
    shape = mesh_shape(parallel(), 4)
    assert shape.axes == ("shard",) and shape.sizes == (4,)


@pytest.mark.unit
def test_a_replicate_degree_that_does_not_divide_the_world_names_the_numbers():
    with pytest.raises(
        ConfigError,
        match=r"parallel.replicate' \(3\) x parallel.tensor_parallel \(1\) = 3 must divide the world size \(4\)",
    ):
        mesh_shape(parallel("parallel.replicate=3"), 4)


@pytest.mark.unit
def test_tp_is_the_innermost_axis_and_a_tp_group_reads_one_slice():
    tp2 = (HF, LLAMA, PLAN, "parallel.tensor_parallel=2")
    shape = mesh_shape(parallel("parallel.replicate=2", *tp2), 8)
    assert shape.axes == ("replicate", "shard", "tp") and shape.sizes == (2, 2, 2)
    assert shape.dp_size == 4 and [shape.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    with pytest.raises(
        ConfigError, match=r"\(2\) x parallel.tensor_parallel \(4\) = 8 must divide"
    ):
        mesh_shape(
            parallel("parallel.replicate=2", HF, LLAMA, PLAN, "parallel.tensor_parallel=4"), 4
        )


@pytest.mark.unit
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallel.replicate=0"], "expected a positive integer"),
        (["parallel.backend=zero", "parallel.replicate=2"], "needs parallel.backend=fsdp"),
        (["parallel.tensor_parallel=0"], "expected a positive integer"),
        (
            ["parallel.backend=zero", HF, LLAMA, PLAN, "parallel.tensor_parallel=2"],
            "needs parallel.backend",
        ),
        ([HF, LLAMA, "parallel.tensor_parallel=2"], "key 'parallel.tp_plan' is empty"),
        (
            [HF, LLAMA, "parallel.tp_plan={q_proj: diagonal}"],
            "expected colwise, rowwise or colwise_qkv",
        ),
    ],
)
def test_bad_replicate_settings_are_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config([], ["parallel.backend=fsdp", *overrides])


@pytest.mark.e2e
def test_a_mesh_that_does_not_divide_the_launched_world_exits_2_with_the_numbers(tmp_path):
    """Checked before the process group starts: one of the 4 launched ranks is enough to see it."""
    env = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    result = run_cli(
        "train",
        "configs/tiny.yaml",
        "parallel.backend=fsdp",
        "parallel.replicate=3",
        f"train.out_dir={tmp_path / 'run'}",
        env={**env, "MASTER_PORT": "29999"},
    )
    assert result.returncode == 2, result.stderr
    assert "(3) x parallel.tensor_parallel (1) = 3 must divide the world size (4)" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.unit
def test_the_tp2_preset_names_llamas_layers():
    cfg = load_config(["configs/parallel/tp2-hf-llama.yaml"], [HF, LLAMA])
    assert cfg.parallel.tensor_parallel == 2
    assert cfg.parallel.tp_plan == {
        "self_attn.[qkv]_proj": "colwise",
        "self_attn.o_proj": "rowwise",
        "mlp.gate_proj": "colwise",
        "mlp.up_proj": "colwise",
        "mlp.down_proj": "rowwise",
    }


@pytest.mark.unit
def test_under_tp_the_global_batch_counts_data_parallel_ranks():
    from bigtrain.config import for_world_size

    cfg = load_config(
        ["configs/parallel/tp2-hf-llama.yaml"],
        [HF, LLAMA, "train.global_batch_size=16", "train.micro_batch_size=4"],
    )
    dp_size = mesh_shape(cfg.parallel, 8).dp_size  # 8 ranks, tp 2: 4 read the data
    assert for_world_size(cfg, dp_size, "data-parallel size").train.grad_accum_steps == 1
    with pytest.raises(ConfigError, match=r"\(4\) x data-parallel size \(8\) = 32"):
        for_world_size(cfg, 8, "data-parallel size")
