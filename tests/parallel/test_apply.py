import pytest
import torch

from bigtrain.build import run
from bigtrain.config.schema import ModelConfig
from bigtrain.model.gpt import GPT
from bigtrain.parallel.apply import (
    apply_activation_checkpointing,
    apply_compile,
    transformer_blocks,
)
from bigtrain.parallel.backend import canonical_name
from bigtrain.parallel.env import DistEnv


def test_transforms_keep_canonical_parameter_names():
    model = GPT(ModelConfig(n_layers=2, n_heads=2, d_model=32, seq_len=8, vocab_size=50))
    names = [n for n, _ in model.named_parameters()]
    apply_activation_checkpointing(model, "block")
    apply_compile(model)
    assert [canonical_name(n) for n, _ in model.named_parameters()] == names
    assert len(transformer_blocks(model)) == 2


def test_compiled_blocks_train_like_eager(micro):
    """torch.compile (inductor on CPU) fuses ops, so rounding differs slightly: same losses to 1e-4."""
    opts = [
        "train.max_steps=4",
        "precision.compute_dtype=fp32",
        "train.log_every=1",
        "train.eval_every=0",
        "checkpoint.every=0",
    ]
    eager = run(micro(*opts, out="eager"), DistEnv(), log=lambda *_: None)
    compiled = run(
        micro(*opts, "parallel.compile=true", out="compiled"), DistEnv(), log=lambda *_: None
    )
    assert compiled["loss"] == pytest.approx(eager["loss"], rel=1e-4)
    assert torch.compiler.is_compiling() is False


def test_checkpoint_loads_with_activation_checkpointing_toggled(micro):
    """Names in checkpoints are canonical: a run may turn activation checkpointing on at resume."""
    straight = run(
        micro("train.max_steps=6", "precision.compute_dtype=fp32", out="s"),
        DistEnv(),
        log=lambda *_: None,
    )
    run(
        micro("train.max_steps=6", "precision.compute_dtype=fp32", "train.stop_at_step=3", out="r"),
        DistEnv(),
        log=lambda *_: None,
    )
    resumed = run(
        micro(
            "train.max_steps=6",
            "precision.compute_dtype=fp32",
            "parallel.activation_checkpointing=block",
            out="r",
        ),
        DistEnv(),
        log=lambda *_: None,
    )
    assert resumed["fingerprint"] == straight["fingerprint"]
