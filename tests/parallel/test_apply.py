import json
from pathlib import Path

import pytest
import torch

from bigtrain.build import build_trainer
from bigtrain.config.schema import ModelConfig
from bigtrain.model.gpt import GPT
from bigtrain.parallel.env import DistEnv
from bigtrain.parallel.transforms import (
    apply_activation_checkpointing,
    apply_compile,
    transformer_blocks,
)
from bigtrain.runner import run
from bigtrain.utils.names import canonical_name


@pytest.mark.unit
def test_transforms_keep_canonical_parameter_names():
    model = GPT(ModelConfig(n_layers=2, n_heads=2, d_model=32, seq_len=8, vocab_size=50))
    names = [n for n, _ in model.named_parameters()]
    apply_activation_checkpointing(model, "block")
    apply_compile(model)
    assert [canonical_name(n) for n, _ in model.named_parameters()] == names
    assert len(transformer_blocks(model)) == 2


def losses_and_fingerprint(cfg) -> tuple[list[float], str, int]:
    trainer = build_trainer(cfg, DistEnv())
    try:
        trainer.fit()
        fingerprint = trainer.backend.fingerprint()
    finally:
        trainer.callbacks.close()
    metrics = (Path(cfg.train.out_dir) / "metrics.jsonl").read_text().splitlines()
    losses = [json.loads(m)["loss"] for m in metrics if '"loss"' in m]
    return losses, fingerprint, trainer.loader.prefetch_hits


PLAIN = [
    "train.max_steps=20",
    "train.log_every=1",
    "train.eval_every=0",
    "checkpoint.every=0",
    "data.prefetch=0",
    "optim.fused=false",
]


# Stated tolerances: options that change no arithmetic must reproduce the plain run bit for bit;
# the fused AdamW kernel (bit-identical on this CPU) and inductor's fusions may round differently:
# their losses agree to a relative 1e-4 (fused) and 2e-3 (compile, FP32 compute) at every step.
@pytest.mark.e2e
@pytest.mark.parametrize(
    ("option", "rel"),
    [
        ("data.prefetch=2", 0.0),
        ("parallel.activation_checkpointing=block", 0.0),
        ("parallel.activation_checkpointing=selective", 0.0),
        ("optim.fused=true", 1e-4),
        ("parallel.compile=true", 2e-3),
    ],
)
def test_speed_option_keeps_the_loss_of_the_plain_run(micro, option, rel):
    dtype = (
        "precision.compute_dtype=fp32" if "compile" in option else "precision.compute_dtype=bf16"
    )
    plain, plain_fp, _ = losses_and_fingerprint(micro(*PLAIN, dtype, out="plain"))
    losses, fingerprint, hits = losses_and_fingerprint(micro(*PLAIN, dtype, option, out="option"))
    assert len(losses) == len(plain) == 20
    if rel == 0.0:
        assert losses == plain and fingerprint == plain_fp
    else:
        assert losses == pytest.approx(plain, rel=rel)
    if option.startswith("data.prefetch"):
        assert hits == 19  # every step after the first came from the read-ahead
    assert torch.compiler.is_compiling() is False


@pytest.mark.e2e
def test_checkpoint_loads_with_activation_checkpointing_toggled(micro):
    """Names in checkpoints are canonical: a run may turn activation checkpointing on at resume."""
    straight = run(
        micro("train.max_steps=6", "precision.compute_dtype=fp32", out="s"),
        DistEnv(),
    )
    run(
        micro("train.max_steps=6", "precision.compute_dtype=fp32", "train.stop_at_step=3", out="r"),
        DistEnv(),
    )
    resumed = run(
        micro(
            "train.max_steps=6",
            "precision.compute_dtype=fp32",
            "parallel.activation_checkpointing=block",
            out="r",
        ),
        DistEnv(),
    )
    assert resumed["fingerprint"] == straight["fingerprint"]


@pytest.mark.unit
def test_selective_checkpointing_refuses_dropout(micro):
    from bigtrain.errors import ConfigError

    with pytest.raises(ConfigError, match="selective with model.dropout"):
        micro("parallel.activation_checkpointing=selective", "model.dropout=0.1")
