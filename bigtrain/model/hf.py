"""transformers causal LMs behind the same interface as the built-in GPT: token ids -> logits."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bigtrain.errors import ConfigError

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


class HFCausalLM(nn.Module):
    """Wraps a transformers `*ForCausalLM` so that forward(ids) returns logits, without a KV cache."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.hf = model

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=idx, use_cache=False).logits


def build_hf(
    hf_config: dict[str, Any] | None,
    hf_path: str | None,
    vocab_size: int | None,
    init_from: str | None = None,
) -> HFCausalLM:
    """A causal LM from a local directory (weights loaded when present), a hub name, or a config
    dict with `model_type`. Weights are FP32: the precision policy decides the compute dtype.
    With `init_from` the weights come later, sliced per rank (resume.init_from): only the
    architecture is built here, from hf_path, hf_config or init_from's config.json."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if init_from and not hf_config:
        config_dir = hf_path or init_from
        if not (Path(config_dir) / "config.json").is_file():
            raise ConfigError(
                f"model.kind=hf with model.init_from: '{config_dir}' has no config.json (expected "
                "a transformers model directory, or set model.hf_config)"
            )
        config = AutoConfig.from_pretrained(config_dir)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    elif hf_path:
        local = Path(hf_path)
        if local.exists() and not (local / "config.json").is_file():
            raise ConfigError(
                f"model.hf_path '{hf_path}' has no config.json (expected a transformers model directory)"
            )
        has_weights = local.is_dir() and any((local / f).exists() for f in WEIGHT_FILES)
        if has_weights or not local.exists():  # a local checkpoint, or a hub name
            model = AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32)
        else:
            model = AutoModelForCausalLM.from_config(
                AutoConfig.from_pretrained(hf_path), dtype=torch.float32
            )
    else:
        assert hf_config is not None
        options = dict(hf_config)
        model_type = options.pop("model_type")
        if vocab_size is not None:
            options.setdefault("vocab_size", vocab_size)
        config = _config_for(model_type, options)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if vocab_size is not None and model.config.vocab_size < vocab_size:
        raise ConfigError(
            f"model.hf_config/hf_path: vocab_size {model.config.vocab_size} is smaller than the tokenizer's {vocab_size}"
        )
    return HFCausalLM(model)


def _config_for(model_type: str, options: dict):
    """transformers' config of `model_type`; an unknown type names the close matches only."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    known = list(CONFIG_MAPPING.keys())
    if model_type not in known:
        close = difflib.get_close_matches(str(model_type), known, n=6, cutoff=0.5)
        hint = f"; close matches: {', '.join(close)}" if close else ""
        raise ConfigError(
            f"key 'model.hf_config': unknown model_type {model_type!r} (transformers "
            f"{transformers_version()} knows {len(known)} types{hint})"
        )
    try:
        return AutoConfig.for_model(model_type, **options)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"key 'model.hf_config': {e}".splitlines()[0]) from None


def transformers_version() -> str:
    import transformers

    return transformers.__version__
