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
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bigtrain.checkpoint.hf_export import check_export, export_hf
from bigtrain.checkpoint.manager import open_checkpoint
from bigtrain.checkpoint.sources import Source
from bigtrain.config import Config, load_saved_config
from bigtrain.data.tokens import load_tokenizer
from bigtrain.errors import ConfigError
from bigtrain.model import architecture_only, build_model
from bigtrain.model.hf_mapping import HFMapping, mapping_for, mapping_for_hf

logger = logging.getLogger(__name__)


def export_checkpoint(
    path: Path, out_dir: Path, max_shard_bytes: int, check: bool = False
) -> dict[str, Any]:
    """Export checkpoint `path` (verified first; a run directory: its newest committed
    checkpoint) into `out_dir`; with `check`, also compare the logits (FP32). Returns what was
    written and, with check, the comparison."""
    path, manifest, source = open_checkpoint(path)
    cfg = with_saved_hf_config(load_saved_config(path / "config.yaml"), path)
    tokenizer_dir = path / "tokenizer" if (path / "tokenizer").is_dir() else None
    shapes = manifest.get("shapes") or source.shapes  # as the source reads
    vocab_size = vocab_size_of(cfg, shapes, tokenizer_dir)
    mapping = checkpoint_mapping(cfg, shapes, vocab_size)
    files = export_hf(mapping, source.full, out_dir, tokenizer_dir, max_shard_bytes)
    result: dict[str, Any] = {
        "checkpoint": str(path),
        "out_dir": str(out_dir),
        "architecture": mapping.architecture,
        "files": files,
        "step": manifest["step"],
    }
    if check:
        model = model_from_source(cfg, vocab_size, source)
        result["check"] = check_export(model, out_dir, vocab_size, cfg.model.seq_len)
    return result


def with_saved_hf_config(cfg: Config, path: Path) -> Config:
    """A model.kind=hf checkpoint carries its transformers config (hf_config.json): the
    architecture then comes from the checkpoint, not from hf_path or init_from, which may be gone."""
    saved = path / "hf_config.json"
    if cfg.model.kind != "hf" or not saved.is_file():
        return cfg
    model = dataclasses.replace(cfg.model, hf_config=json.loads(saved.read_text()), hf_path=None)
    return dataclasses.replace(cfg, model=model)


def vocab_size_of(cfg: Config, shapes: dict[str, tuple], tokenizer_dir: Path | None) -> int:
    """The vocabulary the model was built with: model.vocab_size, else the tokenizer's size (as
    at training time), else the embedding table's rows."""
    if cfg.model.vocab_size:
        return cfg.model.vocab_size
    if tokenizer_dir is not None:
        return len(load_tokenizer(str(tokenizer_dir)))
    if "tok_emb.weight" in shapes:
        return shapes["tok_emb.weight"][0]
    raise ConfigError(
        "the checkpoint does not say its vocabulary size (no model.vocab_size in its config.yaml, "
        "no tokenizer/ directory)"
    )


def checkpoint_mapping(cfg: Config, shapes: dict[str, tuple], vocab_size: int) -> HFMapping:
    if cfg.model.kind == "gpt":
        return mapping_for(dataclasses.replace(cfg.model, vocab_size=vocab_size), shapes)
    with torch.device("meta"):  # the architecture only: the weights come from the checkpoint
        built = build_model(architecture_only(cfg.model), vocab_size)
    return mapping_for_hf(built.hf.config, shapes)  # type: ignore[union-attr]


@torch.no_grad()
def model_from_source(cfg: Config, vocab_size: int, source: Source) -> nn.Module:
    """bigtrain's model of the checkpoint's config in FP32 on the CPU, holding its weights."""
    model = build_model(architecture_only(cfg.model), vocab_size, init_seed=None)  # copied below
    for name, p in model.named_parameters():
        p.copy_(source.full(name))
    return model
