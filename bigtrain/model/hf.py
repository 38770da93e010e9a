"""transformers causal LMs behind the same interface as the built-in GPT: token ids -> logits."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bigtrain.errors import ConfigError
from bigtrain.model.gpt import SequenceChunks

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
        self.context: SequenceChunks | None = None
        """Set by context parallelism (parallel/context/hf.py): forward takes whole sequences
        and feeds transformers this rank's chunks of them with their true position ids."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if self.context is None:
            return self.hf(input_ids=idx, use_cache=False).logits
        positions = self.context.local(torch.arange(idx.shape[1], device=idx.device), dim=0)
        return self.hf(
            input_ids=self.context.local(idx), position_ids=positions.unsqueeze(0), use_cache=False
        ).logits


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


HF_STAGE_FAMILIES = {
    # model_type -> (family, block container, first stage's modules, last stage's modules)
    "llama": (
        "llama",
        "hf.model.layers",
        ("hf.model.embed_tokens",),
        ("hf.model.norm", "hf.lm_head"),
    ),
    "mistral": (
        "llama",
        "hf.model.layers",
        ("hf.model.embed_tokens",),
        ("hf.model.norm", "hf.lm_head"),
    ),
    "qwen2": (
        "llama",
        "hf.model.layers",
        ("hf.model.embed_tokens",),
        ("hf.model.norm", "hf.lm_head"),
    ),
    "gpt2": (
        "gpt2",
        "hf.transformer.h",
        ("hf.transformer.wte", "hf.transformer.wpe"),
        ("hf.transformer.ln_f", "hf.lm_head"),
    ),
}
"""The transformers architectures a pipeline stage can be cut from (parallel/pipeline/split.py);
config/parallel.py's PP_HF_TYPES lists the same types."""


def hf_stage_family(model: HFCausalLM) -> tuple[str, str, tuple[str, ...], tuple[str, ...]]:
    """HF_STAGE_FAMILIES' entry of the model's type; ConfigError naming the supported ones."""
    model_type = model.hf.config.model_type
    if model_type not in HF_STAGE_FAMILIES:
        raise ConfigError(
            f"key 'parallel.pipeline_parallel': model.kind=hf with model_type {model_type!r} is "
            f"not split into stages yet (supported: {', '.join(HF_STAGE_FAMILIES)})"
        )
    return HF_STAGE_FAMILIES[model_type]


class HFStage(HFCausalLM):
    """One pipeline stage of a transformers causal LM (pipeline_split.stage_module prunes it):
    token ids or the previous stage's hidden states in, hidden states or logits out, through its
    own decoder layers only, called as transformers' own model forward calls them (causal mask,
    positions 0.., rotary tables of Llama-family models computed on every stage)."""

    def __init__(
        self, model: nn.Module, family: str, takes_tokens: bool, gives_logits: bool
    ) -> None:
        super().__init__(model)
        self.family, self.takes_tokens, self.gives_logits = family, takes_tokens, gives_logits

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        from transformers.masking_utils import create_causal_mask

        if self.family == "gpt2":
            body, layers, norm = self.hf.transformer, self.hf.transformer.h, "ln_f"
        else:
            body, layers, norm = self.hf.model, self.hf.model.layers, "norm"
        seq = idx.shape[1]
        positions = torch.arange(seq, device=idx.device).unsqueeze(0)
        if self.takes_tokens:
            h = (
                body.embed_tokens(idx)
                if self.family != "gpt2"
                else body.wte(idx) + body.wpe(positions)
            )
            if self.family == "gpt2":
                h = body.drop(h)
        else:
            h = idx
        mask = create_causal_mask(
            config=body.config,
            inputs_embeds=h,
            attention_mask=None,
            cache=None,
            position_ids=positions,
        )
        if self.family == "gpt2":
            for block in layers.values():
                h = block(h, None, mask, None, use_cache=False, position_ids=positions)
        else:
            rotary = body.rotary_emb(h, position_ids=positions)
            for layer in layers.values():
                h = layer(
                    h,
                    attention_mask=mask,
                    position_embeddings=rotary,
                    position_ids=positions,
                    cache=None,
                    use_cache=False,
                )
        if not self.gives_logits:
            return h
        return self.hf.lm_head(getattr(body, norm)(h))
