"""`bigtrain export` and `bigtrain ckpt convert` from the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bigtrain.build import run
from bigtrain.parallel.env import read_env
from tests.conftest import run_cli

pytestmark = pytest.mark.e2e


def test_export_and_convert_cli(micro, tmp_path):
    cfg = micro("train.max_steps=3", "checkpoint.every=3", "precision.compute_dtype=fp32")
    run(cfg, read_env())
    checkpoint = Path(cfg.train.out_dir) / "checkpoints" / "step_00000003"
    out = tmp_path / "hf"
    done = run_cli(
        "export", str(checkpoint), "--hf", str(out), "--max-shard-size", "100KB", "--check"
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["architecture"] == "GPT2LMHeadModel" and result["check"]["ok"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded at 100 KB
    again = run_cli("export", str(checkpoint), "--hf", str(out))
    assert again.returncode == 2 and "Traceback" not in again.stderr
    assert (out / "config.json").is_file()  # a refused export leaves the directory alone
    converted = tmp_path / "consolidated"
    done = run_cli("ckpt", "convert", str(checkpoint), "--to", "local", str(converted))
    assert done.returncode == 0 and "step 3" in done.stdout, done.stderr
    assert run_cli("ckpt", "verify", str(converted)).returncode == 0
    bad = run_cli(
        "ckpt", "convert", str(tmp_path / "nowhere"), "--to", "local", str(tmp_path / "x")
    )
    assert bad.returncode == 2 and "nowhere" in bad.stderr and "Traceback" not in bad.stderr


def test_export_a_transformers_model_without_its_source_directory(micro, tmp_path):
    # model.kind=hf from hf_config: the checkpoint carries the config (hf_config.json)
    cfg = micro(
        "model.kind=hf",
        "model.hf_config={model_type: llama, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1, num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 32}",
        "train.max_steps=2",
        "checkpoint.every=2",
        "precision.compute_dtype=fp32",
    )
    run(cfg, read_env())
    checkpoint = Path(cfg.train.out_dir) / "checkpoints" / "step_00000002"
    assert json.loads((checkpoint / "hf_config.json").read_text())["model_type"] == "llama"
    done = run_cli("export", str(checkpoint), "--hf", str(tmp_path / "hf"), "--check")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["architecture"] == "LlamaForCausalLM" and result["check"]["ok"]
