"""`bigtrain export CHECKPOINT --hf OUT`: a checkpoint of any backend and world size as a
transformers model directory.

The checkpoint's own config (its `config.yaml`) says which model it holds: bigtrain's GPT maps onto
GPT2LMHeadModel or LlamaForCausalLM (model/hf_mapping.py), a `model.kind=hf` model is written in its
own class. Tensors stream from the checkpoint (checkpoint/state.py CheckpointReader) one at a
time, so memory holds at most one shard plus one tensor. `--check` then loads the directory with
transformers and compares its logits with bigtrain's own forward of the same weights.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bigtrain.checkpoint.hf_export import check_export, export_hf
from bigtrain.checkpoint.manager import open_checkpoint
from bigtrain.checkpoint.sources import Source
from bigtrain.checkpoint.state_io import persistent_buffers
from bigtrain.config import Config, ModelConfig, load_saved_config
from bigtrain.data.prepare.cache import load_tokenizer
from bigtrain.errors import ConfigError
from bigtrain.model import architecture_only, build_model
from bigtrain.model.hf_mapping import HFMapping, mapping_for, mapping_for_hf

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SavedModel:
    """A verified checkpoint's model as it was trained: its config, tensors, tokenizer."""

    path: Path
    manifest: dict[str, Any]
    cfg: Config  # the checkpoint's own config.yaml (a transformers model's config from it)
    source: Source  # its tensors by canonical name, read one at a time
    tokenizer_dir: Path | None
    vocab_size: int

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    @property
    def shapes(self) -> dict[str, tuple]:
        return self.manifest.get("shapes") or self.source.shapes  # as the source reads

    def model(self) -> nn.Module:
        """bigtrain's model of the checkpoint in FP32 on the CPU, holding its weights."""
        return model_from_source(self.cfg.model, self.vocab_size, self.source)


def open_saved_model(path: Path) -> SavedModel:
    """Checkpoint `path` (verified; a run directory: its newest committed checkpoint)."""
    path, manifest, source = open_checkpoint(path)
    cfg = load_saved_config(path / "config.yaml")
    cfg = dataclasses.replace(cfg, model=with_saved_hf_config(cfg.model, path))
    tokenizer_dir = path / "tokenizer" if (path / "tokenizer").is_dir() else None
    shapes = manifest.get("shapes") or source.shapes
    vocab_size = vocab_size_of(cfg.model, shapes, tokenizer_dir)
    return SavedModel(path, manifest, cfg, source, tokenizer_dir, vocab_size)


def export_checkpoint(
    path: Path, out_dir: Path, max_shard_bytes: int, check: bool = False
) -> dict[str, Any]:
    """Export checkpoint `path` (verified first; a run directory: its newest committed
    checkpoint) into `out_dir`; with `check`, also compare the logits (FP32). Returns what was
    written and, with check, the comparison."""
    saved = open_saved_model(path)
    mapping = checkpoint_mapping(
        saved.cfg.model, saved.shapes, saved.vocab_size, saved.source.shapes
    )
    files = export_hf(mapping, saved.source.full, out_dir, saved.tokenizer_dir, max_shard_bytes)
    result: dict[str, Any] = {
        "checkpoint": str(saved.path),
        "out_dir": str(out_dir),
        "architecture": mapping.architecture,
        "files": files,
        "step": saved.step,
    }
    if check:
        seq_len = saved.cfg.model.seq_len
        result["check"] = check_export(saved.model(), out_dir, saved.vocab_size, seq_len)
    return result


def with_saved_hf_config(model: ModelConfig, path: Path) -> ModelConfig:
    """A model.kind=hf checkpoint carries its transformers config (hf_config.json): the
    architecture then comes from the checkpoint, not from hf_path or init_from, which may be gone."""
    saved = path / "hf_config.json"
    if model.kind != "hf" or not saved.is_file():
        return model
    return dataclasses.replace(model, hf_config=json.loads(saved.read_text()), hf_path=None)


def vocab_size_of(model: ModelConfig, shapes: dict[str, tuple], tokenizer_dir: Path | None) -> int:
    """The vocabulary the model was built with: model.vocab_size, else the tokenizer's size (as
    at training time), else the embedding table's rows."""
    if model.vocab_size:
        return model.vocab_size
    if tokenizer_dir is not None:
        return len(load_tokenizer(str(tokenizer_dir)))
    if "tok_emb.weight" in shapes:
        return shapes["tok_emb.weight"][0]
    raise ConfigError(
        "the checkpoint does not say its vocabulary size (no model.vocab_size in its config.yaml, "
        "no tokenizer/ directory)"
    )


def checkpoint_mapping(
    model: ModelConfig,
    shapes: dict[str, tuple],
    vocab_size: int,
    stored: dict[str, tuple] | None = None,
) -> HFMapping:
    """The transformers mapping of a checkpoint's model, whose parameters have `shapes`. A
    transformers model's persistent buffers that the checkpoint holds (`stored`: every tensor
    it has; DeepSeek-V3's router score correction) are written too."""
    if model.kind == "gpt":
        return mapping_for(dataclasses.replace(model, vocab_size=vocab_size), shapes)
    with torch.device("meta"):  # the architecture only: the weights come from the checkpoint
        built = build_model(architecture_only(model), vocab_size)
    buffers = {n: tuple(b.shape) for n, b in persistent_buffers(built).items()}
    shapes = {**shapes, **{n: s for n, s in buffers.items() if n in (stored or {})}}
    return mapping_for_hf(built.hf.config, shapes)  # type: ignore[union-attr]


@torch.no_grad()
def model_from_source(model_cfg: ModelConfig, vocab_size: int, source: Source) -> nn.Module:
    """bigtrain's model of `model_cfg` in FP32 on the CPU, holding the source's weights."""
    model = build_model(architecture_only(model_cfg), vocab_size, init_seed=None)  # copied below
    for name, p in model.named_parameters():
        p.copy_(source.full(name))
    for name, buffer in persistent_buffers(model).items():
        value = source.buffer(name)
        if value is not None:
            buffer.copy_(value.view(buffer.shape))
    return model
