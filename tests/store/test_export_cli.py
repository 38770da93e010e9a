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
