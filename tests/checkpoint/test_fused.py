"""Checkpoints from before the GPT split its fused layers (`attn.qkv`, SwiGLU's [gate; up] in
`mlp.up`) keep loading: a resume continues the run bit for bit, and init_from and export read them under today's names once `bigtrain ckpt convert` rewrote them. The old files are made
from a new checkpoint by fusing its tensors back, weights and AdamW moments alike, in the
`local` layout of format 1: the renaming wraps any backend's legacy reader
(checkpoint/legacy.py UnfusedSource) in the same way, and tests/checkpoint/test_sources.py reads
a fused `fsdp` (DCP) checkpoint through it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from bigtrain.checkpoint.convert import convert
from bigtrain.checkpoint.export import export_checkpoint
from bigtrain.checkpoint.legacy import UnfusedSource, legacy_source
from bigtrain.checkpoint.manifest import CheckpointError
from bigtrain.checkpoint.state import CheckpointReader
from bigtrain.config import load_config
from bigtrain.optim.optimizer import MOMENTS
from bigtrain.parallel.backends.base import weights_fingerprint
from bigtrain.parallel.env import read_env
from bigtrain.runner import run
from bigtrain.store.rundir import read_jsonl
from bigtrain.utils.files import sha256_file
from tests.conftest import micro_overrides

pytestmark = pytest.mark.e2e

LAYOUTS = {
    "gpt2": [],
    "llama": [
        "model.position=rope",
        "model.norm=rmsnorm",
        "model.mlp=swiglu",
        "model.bias=true",  # biases split with their weights
        "model.n_heads=4",
        "model.n_kv_heads=2",
    ],
}


def fused_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Today's tensors (keys may go on: `<name>.exp_avg`) in the layout of before the split: q, k,
    v rows under `attn.qkv`, SwiGLU's gate and up rows under `mlp.up`."""
    out = {}
    for key, value in tensors.items():
        if ".attn.q." in key:
            parts = [tensors[key.replace(".attn.q.", f".attn.{x}.")] for x in "qkv"]
            out[key.replace(".attn.q.", ".attn.qkv.")] = torch.cat(parts)
        elif ".mlp.gate." in key:
            up = key.replace(".mlp.gate.", ".mlp.up.")
            out[up] = torch.cat([value, tensors[up]])
        elif not (".attn.k." in key or ".attn.v." in key or key in out):
            out[key] = value
    return out


def fused_names(names) -> list[str]:
    return list(fused_tensors({n: torch.zeros(1) for n in names}))


def fused_legacy_checkpoint(new: Path, old: Path) -> None:
    """Checkpoint `new` rewritten at `old` as the `local` layout of format 1 (model.safetensors,
    optimizer.safetensors with the step counts in its metadata) of before the split: fused."""
    reader = CheckpointReader(new)
    old.mkdir()
    kept = ["trainer.json", "config.yaml", "rng_rank0.pt"]
    for name in kept:
        shutil.copyfile(new / name, old / name)
    shutil.copytree(new / "tokenizer", old / "tokenizer")
    weights = fused_tensors({n: reader.full(n) for n in reader.shapes})
    moments = {
        f"{n}.{k}": reader.full(n, k) for n in reader.shapes if reader.step(n) for k in MOMENTS
    }
    steps = {n: reader.step(n) for n in reader.shapes if reader.step(n)}
    renamed = {n: n.replace(".attn.qkv.", ".attn.q.") for n in fused_names(steps)}
    meta = {"steps": json.dumps({n: steps[was] for n, was in renamed.items()})}  # q's count
    save_file(weights, str(old / "model.safetensors"))
    save_file(fused_tensors(moments), str(old / "optimizer.safetensors"), metadata=meta)
    manifest = json.loads((new / "manifest.json").read_text())
    manifest["format_version"] = 1
    manifest["shapes"] = {n: list(weights[n].shape) for n in fused_names(manifest["shapes"])}
    files = [*kept, "model.safetensors", "optimizer.safetensors"]
    files += [f"tokenizer/{p.name}" for p in (old / "tokenizer").iterdir()]
    manifest["files"] = {
        name: {"size": (old / name).stat().st_size, "sha256": sha256_file(old / name)}
        for name in files
    }
    (old / "manifest.json").write_text(json.dumps(manifest, indent=1))


def train(overrides: list[str]) -> dict:
    cfg = load_config([], overrides)
    final = run(cfg, read_env())
    metrics = read_jsonl(Path(cfg.train.out_dir) / "metrics.jsonl")
    return {"final": final, "losses": {m["step"]: m["loss"] for m in metrics if "loss" in m}}


def args_for(out: Path, layout: str, corpus_files, cache_dir, *extra: str) -> list[str]:
    return micro_overrides(out, corpus_files, cache_dir) + [
        *LAYOUTS[layout],
        "train.max_steps=6",
        "train.log_every=1",
        "train.eval_every=0",
        "checkpoint.every=3",
        "checkpoint.async_save=false",
        "precision.compute_dtype=fp32",
        *extra,
    ]


@pytest.fixture(scope="module", params=list(LAYOUTS))
def reference(request, tmp_path_factory, corpus_files, cache_dir) -> dict:
    """A 6-step run with checkpoints at 3 and 6, its step-3 checkpoint in the fused layout of
    format 1, and that converted (`bigtrain ckpt convert`)."""
    tmp = tmp_path_factory.mktemp(f"fused-{request.param}")
    result = train(args_for(tmp / "run", request.param, corpus_files, cache_dir))
    new = tmp / "run" / "checkpoints" / "step_00000003"
    fused_legacy_checkpoint(new, tmp / "old")
    manifest = convert(tmp / "old", tmp / "converted")
    return {**result, "layout": request.param, "new": new, "old": tmp / "old"} | {
        "converted": tmp / "converted",
        "manifest": manifest,
    }


def test_the_old_checkpoint_holds_fused_tensors(reference):
    shapes = json.loads((reference["old"] / "manifest.json").read_text())["shapes"]
    assert shapes["blocks.1.attn.qkv.weight"] == (
        [128, 64] if reference["layout"] == "llama" else [192, 64]
    )
    assert "blocks.1.attn.q.weight" not in shapes and "blocks.1.mlp.gate.weight" not in shapes
    source = legacy_source(reference["old"], "local")
    assert isinstance(source, UnfusedSource)
    assert source.shapes == CheckpointReader(reference["new"]).shapes


def test_a_converted_fused_checkpoint_holds_todays_tensors_bit_for_bit(reference):
    new, converted = CheckpointReader(reference["new"]), CheckpointReader(reference["converted"])
    names = json.loads((reference["new"] / "manifest.json").read_text())["shapes"]
    assert reference["manifest"]["shapes"] == names
    assert converted.shapes == new.shapes
    for name in names:
        assert converted.step(name) == new.step(name) > 0, name
        for key in ("param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(converted.full(name, key), new.full(name, key)), (name, key)


def test_resume_from_a_converted_fused_checkpoint_continues_the_run(
    reference, tmp_path, corpus_files, cache_dir
):
    run_dir = tmp_path / "run"
    shutil.copytree(reference["old"], run_dir / "checkpoints" / "step_00000003")
    args = args_for(run_dir, reference["layout"], corpus_files, cache_dir)
    with pytest.raises(CheckpointError, match="bigtrain ckpt convert"):
        train(args)  # the old one is refused, naming the command
    shutil.rmtree(run_dir / "checkpoints" / "step_00000003")
    shutil.copytree(reference["converted"], run_dir / "checkpoints" / "step_00000003")
    resumed = train(args)
    assert resumed["final"]["step"] == 6
    assert resumed["final"]["fingerprint"] == reference["final"]["fingerprint"]
    for step in (4, 5, 6):  # the same weights, moments and step counts: the same losses
        assert resumed["losses"][step] == reference["losses"][step], step


def test_init_from_and_export_read_a_converted_fused_checkpoint(
    reference, tmp_path, corpus_files, cache_dir
):
    new = CheckpointReader(reference["new"])
    names = json.loads((reference["new"] / "manifest.json").read_text())["shapes"]
    expected = weights_fingerprint((n, lambda n=n: new.full(n)) for n in names)
    args = args_for(tmp_path / "init", reference["layout"], corpus_files, cache_dir)
    train([*args, "train.max_steps=1", f"model.init_from={reference['converted']}"])
    event = next(
        e for e in read_jsonl(tmp_path / "init" / "events.jsonl") if e["kind"] == "init_from"
    )
    assert event["fingerprint"] == expected
    # export: the same files as the new checkpoint's, and transformers agrees
    old = export_checkpoint(reference["converted"], tmp_path / "old-hf", 1 << 16, check=True)
    export_checkpoint(reference["new"], tmp_path / "new-hf", 1 << 16)
    assert old["check"]["ok"], old["check"]
    for file in sorted((tmp_path / "new-hf").glob("*.safetensors")):
        written = load_file(str(tmp_path / "old-hf" / file.name))
        assert written.keys() == load_file(str(file)).keys()
        assert all(torch.equal(t, load_file(str(file))[k]) for k, t in written.items()), file.name
