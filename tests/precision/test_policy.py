import pytest
import torch

from bigtrain.config import load_config
from bigtrain.errors import ConfigError
from bigtrain.precision import Hardware, resolve_policy
from tests.conftest import run_cli

V100 = Hardware("cuda", "V100", cuda_capability=(7, 0))
A100 = Hardware("cuda", "A100", cuda_capability=(8, 0))
H100 = Hardware("cuda", "H100", cuda_capability=(9, 0))
CPU_BF16 = Hardware("cpu", "Sapphire Rapids", cpu_bf16=True)
CPU_OLD = Hardware("cpu", "Broadwell", cpu_bf16=False)


def policy(hw, n=10**8, *overrides):
    return resolve_policy(load_config([], list(overrides)).precision, hw, n)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("hw", "compute", "scaling", "tf32"),
    [
        (V100, torch.float16, "dynamic", False),
        (A100, torch.bfloat16, "none", True),
        (H100, torch.bfloat16, "none", True),
        (CPU_BF16, torch.bfloat16, "none", False),
        (CPU_OLD, torch.float32, "none", False),
    ],
)
def test_auto_by_hardware(hw, compute, scaling, tf32):
    p = policy(hw)
    assert (p.compute_dtype, p.loss_scaling, p.allow_tf32) == (compute, scaling, tf32)
    assert p.master_dtype == p.reduce_dtype == torch.float32
    assert p.reasons["compute"].startswith("auto:")


@pytest.mark.unit
def test_size_thresholds():
    assert not policy(A100, 6_900_000_000).fp32_softmax
    assert policy(A100, 7_000_000_000).fp32_softmax
    assert not policy(A100, 19_000_000_000).adaptive_clip
    assert policy(A100, 20_000_000_000).adaptive_clip
    with pytest.raises(ConfigError, match="FP16 is refused from 20B"):
        policy(V100, 20_000_000_000)
    with pytest.raises(ConfigError, match="FP16 is refused from 20B"):
        policy(A100, 30_000_000_000, "precision.compute_dtype=fp16")


@pytest.mark.unit
def test_presets_and_explicit_keys():
    assert policy(A100, 10**8, "precision.preset=fp16-mixed").loss_scaling == "dynamic"
    assert policy(A100, 10**8, "precision.preset=fp32").compute_dtype == torch.float32
    p = policy(V100, 10**8, "precision.preset=fp16-mixed", "precision.compute_dtype=fp32")
    assert (
        p.compute_dtype == torch.float32 and p.reasons["compute"] == "precision.compute_dtype=fp32"
    )
    assert (
        policy(A100, 10**8, "precision.optimizer_state_dtype=fp16").optimizer_state_dtype
        == torch.float16
    )
    table = policy(A100, 10**8, "precision.fp32_modules=[lm_head]").table()
    assert "fp32 modules" in table and "lm_head" in table


@pytest.mark.unit
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["precision.compute_dtype=fp16", "precision.loss_scaling=none"],
            "precision.compute_dtype=fp16 with precision.loss_scaling=none",
        ),
        (
            ["precision.compute_dtype=bf16", "precision.loss_scaling=dynamic"],
            "precision.loss_scaling=dynamic with precision.compute_dtype=bf16",
        ),
        (
            ["precision.compute_dtype=fp32", "precision.loss_scaling=static"],
            "precision.loss_scaling=static with FP32 compute",
        ),
        (
            ["precision.optimizer_state_dtype=fp16", "precision.optimizer_state_scaling=none"],
            "optimizer_state_scaling=none",
        ),
        (["precision.schedule=[{until: 0.5, compute_dtype: fp32}]"], "the last phase ends at 0.5"),
        (
            [
                "precision.schedule=[{until: 0.5, compute_dtype: fp32}, {until: 0.4, compute_dtype: bf16}]"
            ],
            "precision.schedule[1].until",
        ),
    ],
)
def test_contradictions_name_the_keys(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        policy(A100, 10**8, *overrides)


@pytest.mark.unit
def test_bf16_loss_scaling_when_asked_for():
    p = policy(
        A100,
        10**8,
        "precision.compute_dtype=bf16",
        "precision.loss_scaling=dynamic",
        "precision.allow_bf16_loss_scaling=true",
    )
    assert p.loss_scaling == "dynamic"


@pytest.mark.unit
def test_schedule_phases():
    p = policy(
        A100,
        10**8,
        "precision.schedule=[{until: 0.05, compute_dtype: fp32}, {until: 0.99, compute_dtype: bf16},"
        " {until: 1.0, compute_dtype: bf16, fp32_modules: [lm_head]}]",
    )
    assert [ph.name for ph in p.phases] == ["fp32", "bf16", "bf16+fp32[lm_head]"]
    assert (
        p.phase_at(4, 100).name == "fp32"
        and p.phase_at(5, 100).name == "bf16"
        and p.phase_at(99, 100).name.endswith("]")
    )


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("precision.master_dtype=fp16", "key 'precision.master_dtype' got 'fp16'"),
        ("precision.loss_scaling=dynamic", "precision.loss_scaling=dynamic with"),
    ],
)
def test_cli_exit_2_for_contradictions(override, expected, micro_args):
    args = micro_args(
        override, "precision.compute_dtype=fp32" if "loss_scaling" in override else "train.seed=1"
    )
    result = run_cli("train", *args)
    assert result.returncode == 2 and expected in result.stderr and "Traceback" not in result.stderr
