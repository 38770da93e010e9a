"""parallel.meta_init: built on the meta device, sharded, then each rank materialises its shards;
the initial weights are the same at any world size and follow the model's init rules."""

from __future__ import annotations

import math

import pytest
import torch

from bigtrain.build import build_trainer
from bigtrain.config import load_config
from bigtrain.errors import ConfigError
from bigtrain.model.gpt import rope_tables
from bigtrain.parallel.env import read_env, shutdown
from bigtrain.utils.names import canonical_name
from tests.conftest import micro_overrides
from tests.distributed import run_distributed


def initial_state(args: list[str]) -> dict:
    trainer = build_trainer(load_config([], args), read_env())
    try:
        model = trainer.backend.model
        full = {canonical_name(n): p.full_tensor().clone() for n, p in model.named_parameters()}
        rope = (model.rope_cos.clone(), model.rope_sin.clone())
        fingerprint = trainer.backend.fingerprint()
        trainer.fit()
        return {
            "fingerprint": fingerprint,
            "full": full,
            "rope": rope,
            "loss": trainer.state.last_loss,
        }
    finally:
        trainer.callbacks.close()
        shutdown(clean=False)


@pytest.mark.distributed
def test_meta_init_is_the_same_at_any_world_size_and_follows_the_init_rules(
    tmp_path, corpus_files, cache_dir
):
    extra = [
        "parallel.backend=fsdp",
        "parallel.meta_init=true",
        "model.position=rope",
        "model.norm=rmsnorm",
        "model.n_layers=4",
        "train.max_steps=6",
        "train.eval_every=0",
        "checkpoint.every=0",
        "precision.int8.enabled=true",
        "parallel.activation_checkpointing=block",
    ]
    one = run_distributed(
        initial_state, 1, micro_overrides(tmp_path / "one", corpus_files, cache_dir) + extra
    )[0]
    two = run_distributed(
        initial_state, 2, micro_overrides(tmp_path / "two", corpus_files, cache_dir) + extra
    )
    assert two[0]["fingerprint"] == two[1]["fingerprint"] == one["fingerprint"]
    full = one["full"]
    assert torch.equal(full["blocks.0.norm1.weight"], torch.ones(64))
    # init_std 0.02; residual projections scaled by 1/sqrt(2 x 4 layers)
    assert full["blocks.0.attn.q.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    assert full["blocks.1.mlp.down.weight"].std().item() == pytest.approx(
        0.02 / math.sqrt(8), rel=0.05
    )
    assert full["blocks.0.mlp.up.bias"].abs().max() == 0
    cos, sin = rope_tables(32, 32, 10000.0)
    assert torch.equal(one["rope"][0], cos) and torch.equal(one["rope"][1], sin)
    assert math.isfinite(one["loss"]) and one["loss"] < 6.5


@pytest.mark.unit
def test_meta_init_needs_fsdp(micro):
    with pytest.raises(ConfigError, match="parallel.meta_init=true needs parallel.backend=fsdp"):
        build_trainer(micro("parallel.meta_init=true"), read_env())
