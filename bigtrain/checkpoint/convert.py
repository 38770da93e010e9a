"""`bigtrain ckpt convert CHECKPOINT OUT`: a checkpoint of an earlier bigtrain version (manifest
format 1: each backend's own layout, checkpoint/legacy.py; also the GPT's fused layers of before
the split) rewritten once in today's one format, so the load path never branches on history.

The result is a committed checkpoint (manifest format 2) with the same step, data cursor,
identity, trainer state, config, every rank's RNG state and tokenizer, and the tensors under
today's canonical names: FP32 weights and buffers, FP32 moments and step counts, and what the
backend kept beside them (DeepSpeed's loss scaler and engine counters) in backend.json. It
resumes on any backend at any world size and mesh like any checkpoint; resumed on the backend
and world size that wrote the original, it continues the same trajectory. A current checkpoint
converts too (into one file set written by one process). Reading goes one parameter at a time;
the output is written at once, so this needs the model's FP32 size in host memory three times
(weights and two moments).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from bigtrain.checkpoint import state as checkpoint_state
from bigtrain.checkpoint.legacy import ZeroSource, legacy_source
from bigtrain.checkpoint.manifest import (
    LEGACY_FORMAT_VERSION,
    checkpoint_path,
    hash_files,
    verify,
    write_manifest,
)
from bigtrain.checkpoint.sources import Source
from bigtrain.errors import ConfigError
from bigtrain.model.fused import unfused_calibration, unfused_shapes
from bigtrain.optim.optimizer import MOMENTS
from bigtrain.utils.files import fsync_dir


def convert(path: Path, out: Path) -> dict[str, Any]:
    """Write checkpoint `path` (verified first; a run directory: its newest committed
    checkpoint) in the current format at `out`, which must not exist yet; returns the new
    manifest."""
    if out.exists():
        raise ConfigError(f"output '{out}' exists already; name a new directory")
    if out.parent.exists() and not out.parent.is_dir():
        raise ConfigError(f"output '{out}': its parent is a file, expected a directory")
    path = checkpoint_path(path)
    manifest = verify(path)
    legacy = manifest["format_version"] == LEGACY_FORMAT_VERSION
    source = (
        legacy_source(path, manifest["backend"])
        if legacy
        else checkpoint_state.CheckpointReader(path)
    )
    tmp = out.parent / f".tmp-{out.name}"
    if tmp.exists():
        shutil.rmtree(tmp)  # a conversion that was interrupted
    tmp.mkdir(parents=True)
    written = checkpoint_state.write(tmp, tensors(source), None)
    names = []
    (tmp / "trainer.json").write_text(json.dumps(trainer_state(path, source), indent=1))
    names.append("trainer.json")
    for name in ("config.yaml", *sorted(p.name for p in path.glob("rng_rank*.pt"))):
        shutil.copyfile(path / name, tmp / name)
        names.append(name)
    (tmp / "backend.json").write_text(json.dumps(backend_state(path, manifest, source), indent=1))
    names.append("backend.json")
    if (path / "tokenizer").is_dir():
        shutil.copytree(path / "tokenizer", tmp / "tokenizer")
        names += [f"tokenizer/{f.name}" for f in sorted((tmp / "tokenizer").iterdir())]
    shapes = manifest.get("shapes")
    converted = {
        "step": manifest["step"],
        "backend": manifest["backend"],
        "world_size": manifest["world_size"],
        "data": manifest["data"],
        "identity": manifest["identity"],
        "shapes": unfused_shapes(shapes) if shapes is not None else None,  # today's names
        "converted_from": {
            "format_version": manifest["format_version"],
            "path": str(path),
            "files": len(manifest["files"]),
        },
    }
    write_manifest(tmp, converted, hash_files(tmp, names, written))
    tmp.rename(out)
    fsync_dir(out.parent)
    return json.loads((out / "manifest.json").read_text())


def tensors(source: Source) -> dict[str, torch.Tensor]:
    """Every tensor of `source` under the format's keys (checkpoint/state.py), whole."""
    out: dict[str, torch.Tensor] = {}
    for name in sorted(source.shapes):
        out[f"model.{name}"] = source.full(name).contiguous()
        step = source.step(name)
        if step:
            for key in MOMENTS:
                out[f"optim.{name}.{key}"] = source.full(name, key).contiguous()
            out[f"optim.{name}.step"] = torch.tensor(float(step), dtype=torch.float64)
    for name, value in source.extra_buffers().items():
        out.setdefault(f"model.{name}", value.contiguous())
    return out


def trainer_state(path: Path, source: Source) -> dict[str, Any]:
    """trainer.json, with an INT8 calibration of the fused layers under today's layer names."""
    trainer = json.loads((path / "trainer.json").read_text())
    int8 = (trainer.get("callbacks") or {}).get("int8")
    if int8:
        layers = [n.removesuffix(".weight") for n in source.shapes if n.endswith(".weight")]
        int8["act_amax"] = unfused_calibration(int8["act_amax"], layers)
    return trainer


def backend_state(path: Path, manifest: dict[str, Any], source: Source) -> dict[str, Any]:
    """backend.json of the converted checkpoint: the original's (format 2), or for format 1 the
    loss scale and, from ZeRO's header, DeepSpeed's loss scaler and engine counters."""
    if (path / "backend.json").is_file():
        return json.loads((path / "backend.json").read_text())
    trainer = json.loads((path / "trainer.json").read_text())
    scale = source.loss_scale() or (trainer.get("loss_scaler") or {}).get("scale")
    out: dict[str, Any] = {"backend": manifest["backend"], "loss_scale": scale}
    fused = getattr(source, "fused", source)  # UnfusedSource wraps the file reader
    if isinstance(fused, ZeroSource):
        out |= {"engine": fused.header["engine"], "loss_scaler": fused.header["loss_scaler"]}
    return out
