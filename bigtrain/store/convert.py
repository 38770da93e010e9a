"""`bigtrain ckpt convert CHECKPOINT --to local OUT`: any checkpoint in the consolidated form.

The result is a committed `local` checkpoint (world size 1): `model.safetensors` with every FP32
weight and persistent buffer by canonical name, `optimizer.safetensors` with the FP32 moments and
step counts, and the source's trainer state, config, RNG state and tokenizer. It resumes on any
backend at any world size like any checkpoint, and it is the way to read a checkpoint without the
GPUs (or the DeepSpeed install) that wrote it. Reading goes one parameter at a time; the output
holds the whole model, so this needs the model's FP32 size in host memory (three times, with the
moments).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from bigtrain.config import load_saved_config
from bigtrain.errors import ConfigError
from bigtrain.model.fused import unfused_shapes
from bigtrain.optim.optimizer import MOMENTS
from bigtrain.parallel.sources import Source, checkpoint_source, write_local_layout
from bigtrain.store.checkpoint import checkpoint_path, hash_files, verify, write_manifest
from bigtrain.utils.files import fsync_dir


def convert_to_local(path: Path, out: Path) -> dict:
    """Write checkpoint `path` (verified first; a run directory: its newest committed
    checkpoint) as a local checkpoint at `out`, which must not exist yet; returns the new
    manifest."""
    if out.exists():
        raise ConfigError(f"output '{out}' exists already; name a new directory")
    if out.parent.exists() and not out.parent.is_dir():
        raise ConfigError(f"output '{out}': its parent is a file, expected a directory")
    path = checkpoint_path(path)
    manifest = verify(path)
    source = checkpoint_source(path, manifest["backend"])
    tmp = out.parent / f".tmp-{out.name}"
    if tmp.exists():
        shutil.rmtree(tmp)  # a conversion that was interrupted
    tmp.mkdir(parents=True)
    names = _write_tensors(source, tmp)
    names += ["trainer.json", "config.yaml"]
    shutil.copyfile(path / "config.yaml", tmp / "config.yaml")
    trainer = json.loads((path / "trainer.json").read_text())
    scale = source.loss_scale()  # ZeRO keeps its FP16 loss scale beside its tensors
    if scale is not None and not trainer.get("loss_scaler"):
        hysteresis = load_saved_config(path / "config.yaml").precision.loss_scale_hysteresis
        trainer["loss_scaler"] = {"scale": scale, "clean_steps": 0, "overflows_left": hysteresis}
    (tmp / "trainer.json").write_text(json.dumps(trainer, indent=1))
    rng = path / "rng_rank0.pt"
    if rng.is_file():
        shutil.copyfile(rng, tmp / rng.name)
        names.append(rng.name)
    if (path / "tokenizer").is_dir():
        shutil.copytree(path / "tokenizer", tmp / "tokenizer")
        names += [f"tokenizer/{f.name}" for f in sorted((tmp / "tokenizer").iterdir())]
    shapes = manifest.get("shapes")
    converted = {
        "step": manifest["step"],
        "backend": "local",
        "world_size": 1,
        "data": manifest["data"],
        "identity": manifest["identity"],
        "shapes": unfused_shapes(shapes) if shapes is not None else None,  # as written
        "converted_from": {"backend": manifest["backend"], "world_size": manifest["world_size"]},
    }
    write_manifest(tmp, converted, hash_files(tmp, names))
    tmp.rename(out)
    fsync_dir(out.parent)
    return json.loads((out / "manifest.json").read_text())


def _write_tensors(source: Source, directory: Path) -> list[str]:
    weights: dict[str, torch.Tensor] = {}
    states: dict[str, tuple[float, dict[str, torch.Tensor]]] = {}
    for name in sorted(source.shapes):
        weights[name] = source.full(name).contiguous()
        if source.step(name):
            moments = {k: source.full(name, k).contiguous() for k in MOMENTS}
            states[name] = (source.step(name), moments)
    for name, value in source.extra_buffers().items():
        weights.setdefault(name, value.contiguous())
    return write_local_layout(directory, weights, states)
