"""Models, architecture only: bigtrain's GPT (gpt.py), transformers causal LMs (hf.py), their
initial values (init.py), the loss, generation with a KV cache, and the map between bigtrain's
tensors and a transformers checkpoint's (hf_mapping.py). `build_model` picks one. Nothing here
knows of parallelism, precision or callbacks."""

from __future__ import annotations

import dataclasses

from torch import nn

from bigtrain.config.schema import ModelConfig
from bigtrain.model.gpt import GPT, flops_per_token, num_params


def build_model(cfg: ModelConfig, vocab_size: int, init_seed: int | None = 0) -> nn.Module:
    """Build on the current default device with FP32 weights. `vocab_size` is the tokenizer's.
    init_seed (train.seed) seeds the GPT's per-parameter draws (model/init.py); None leaves them
    undrawn for a build that writes them later. transformers models ignore it: they draw from
    the global RNG (seeded by train.seed) or load their weights."""
    if cfg.kind == "hf":
        from bigtrain.model.hf import build_hf

        return build_hf(cfg.hf_config, cfg.hf_path, cfg.vocab_size or vocab_size, cfg.init_from)
    return GPT(dataclasses.replace(cfg, vocab_size=cfg.vocab_size or vocab_size), init_seed)


def architecture_only(cfg: ModelConfig) -> ModelConfig:
    """A model config that builds the architecture without loading weights (on the meta device,
    or to load them later): a kind=hf model's architecture comes from hf_config, else from
    hf_path's or init_from's config.json."""
    if cfg.kind == "hf" and cfg.hf_config is None:
        return dataclasses.replace(cfg, hf_path=None, init_from=cfg.hf_path or cfg.init_from)
    return dataclasses.replace(cfg, hf_path=None, init_from=None)


def model_flops_per_token(model: nn.Module, cfg: ModelConfig) -> float:
    """Training FLOPs per token of a built model (see gpt.flops_per_token)."""
    if isinstance(model, GPT):  # an MoE block's token goes through top_k of its experts
        return flops_per_token(model.cfg, num_params(model, non_embedding=True, active=True))
    hf_cfg = model.hf.config  # type: ignore[union-attr]
    n_layers = getattr(hf_cfg, "num_hidden_layers", getattr(hf_cfg, "n_layer", 0))
    d_model = getattr(hf_cfg, "hidden_size", getattr(hf_cfg, "n_embd", 0))
    tables = [m.weight for m in model.modules() if isinstance(m, nn.Embedding)]
    # an MoE family's token goes through top_k of each layer's experts (model/routed.py)
    n = num_params(model, active=True) - sum(t.numel() for t in tables)
    out = model.hf.get_output_embeddings()  # type: ignore[union-attr]
    if out is not None and any(out.weight is t for t in tables):
        n += out.weight.numel()  # a tied table still does the output matmul
    return 6.0 * n + 12.0 * n_layers * d_model * cfg.seq_len


__all__ = [
    "GPT",
    "architecture_only",
    "build_model",
    "flops_per_token",
    "model_flops_per_token",
    "num_params",
]
