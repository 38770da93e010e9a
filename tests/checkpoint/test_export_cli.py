"""`bigtrain export` and `bigtrain ckpt convert` from the command line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bigtrain.parallel.env import read_env
from bigtrain.runner import run
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
    done = run_cli("ckpt", "convert", str(checkpoint), str(converted))
    assert done.returncode == 0 and "step 3" in done.stdout, done.stderr
    assert run_cli("ckpt", "verify", str(converted)).returncode == 0
    bad = run_cli("ckpt", "convert", str(tmp_path / "nowhere"), str(tmp_path / "x"))
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


GPT2_STYLE = ["model.position=learned", "model.norm=layernorm", "model.mlp=gelu"]
LLAMA_STYLE = ["model.position=rope", "model.norm=rmsnorm", "model.mlp=swiglu", "model.bias=false"]


@pytest.mark.parametrize(
    ("source", "target", "found", "built"),
    [
        (GPT2_STYLE, LLAMA_STYLE, "GPT2LMHeadModel", "LlamaForCausalLM"),
        (LLAMA_STYLE, GPT2_STYLE, "LlamaForCausalLM", "GPT2LMHeadModel"),
    ],
    ids=["gpt2-into-llama", "llama-into-gpt2"],
)
def test_init_from_an_export_of_the_other_layout_exits_2_naming_both(
    micro, micro_args, tmp_path, source, target, found, built
):
    cfg = micro("train.max_steps=1", "checkpoint.every=1", *source, out="source")
    run(cfg, read_env())
    hf = tmp_path / "hf"
    checkpoint = Path(cfg.train.out_dir) / "checkpoints" / "step_00000001"
    done = run_cli("export", str(checkpoint), "--hf", str(hf))
    assert done.returncode == 0, done.stderr
    started = run_cli("train", *micro_args("train.max_steps=1", *target, f"model.init_from={hf}"))
    assert started.returncode == 2, started.stderr[-2000:]
    (line,) = started.stderr.strip().splitlines()
    assert line.startswith("bigtrain: error: key 'model.init_from'") and str(hf) in line
    assert found in line and built in line  # what the directory holds, what the config builds


def modes(root: Path) -> dict[str, set[str]]:
    """{'files': {...}, 'dirs': {...}}: the permission bits found under root (root included)."""
    found: dict[str, set[str]] = {"files": set(), "dirs": {oct(root.stat().st_mode & 0o777)}}
    for p in root.rglob("*"):
        found["dirs" if p.is_dir() else "files"].add(oct(p.stat().st_mode & 0o777))
    return found


def test_checkpoints_and_exports_get_the_usual_permissions_of_the_umask(micro, tmp_path):
    """Nothing private: files as open() makes them, directories as mkdir() does (safetensors
    writes 0600 files and tempfile.mkdtemp 0700 directories of its own accord)."""
    from bigtrain.checkpoint.export import export_checkpoint

    old = os.umask(0o022)
    try:
        cache = tmp_path / "cache"  # a token cache of its own: built under this umask
        cfg = micro("train.max_steps=2", "checkpoint.every=2", f"data.cache_dir={cache}")
        run(cfg, read_env())
        checkpoint = Path(cfg.train.out_dir) / "checkpoints" / "step_00000002"
        assert modes(checkpoint) == {"files": {"0o644"}, "dirs": {"0o755"}}
        assert modes(cache) == {"files": {"0o644"}, "dirs": {"0o755"}}
        export_checkpoint(checkpoint, tmp_path / "hf", 1 << 16)
        assert modes(tmp_path / "hf") == {"files": {"0o644"}, "dirs": {"0o755"}}
        os.umask(0o027)  # the umask, not a fixed mode
        export_checkpoint(checkpoint, tmp_path / "hf-group", 1 << 16)
        assert modes(tmp_path / "hf-group") == {"files": {"0o640"}, "dirs": {"0o750"}}
    finally:
        os.umask(old)
