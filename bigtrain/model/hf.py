"""transformers causal LMs behind the same interface as the built-in GPT: token ids -> logits."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bigtrain.errors import ConfigError
from bigtrain.model.gpt import SequenceChunks
from bigtrain.model.hf_routers import attach_router_probes
from bigtrain.model.moe import AttachAux, AuxLosses

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


class HFCausalLM(nn.Module, AuxLosses):
    """Wraps a transformers `*ForCausalLM` so that forward(ids) returns logits, without a KV cache.

    An MoE family whose config sets `output_router_logits` (transformers' own switch for training
    with its load-balancing loss) gets that loss in training forwards: the family computes it
    (`aux_loss`, its own formula over every layer's router logits) and it is attached to the
    logits with `router_aux_loss_coef` (`AttachAux`), so its gradient is the one transformers'
    `loss + router_aux_loss_coef * aux_loss` gives, on every backend."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.hf = model
        self.context: SequenceChunks | None = None
        """Set by context parallelism (parallel/context/hf.py): forward takes whole sequences
        and feeds transformers this rank's chunks of them with their true position ids."""

    @property
    def trains_router_loss(self) -> bool:
        """Whether training forwards add the family's load-balancing loss (class docstring)."""
        return bool(getattr(self.hf.config, "output_router_logits", False))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        options: dict = {"use_cache": False}
        aux = self.training and torch.is_grad_enabled() and self.trains_router_loss
        if aux:
            options["output_router_logits"] = True
        if self.context is None:
            out = self.hf(input_ids=idx, **options)
        else:
            positions = self.context.local(torch.arange(idx.shape[1], device=idx.device), dim=0)
            out = self.hf(
                input_ids=self.context.local(idx), position_ids=positions.unsqueeze(0), **options
            )
        if aux and getattr(out, "aux_loss", None) is not None:
            weighted = self.hf.config.router_aux_loss_coef * out.aux_loss
            return AttachAux.apply(out.logits, weighted, self.aux_grad_scale)
        return out.logits


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
    attach_router_probes(model)  # an MoE family's routers, watched by the monitor
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


class HFStage(HFCausalLM):
    """One pipeline stage of a transformers causal LM (parallel/pipeline/split.py prunes it):
    token ids or the previous stage's hidden states in, hidden states or logits out, through
    its own decoder layers only.

    A family that declares a pipeline plan (`family="declared"`) runs through its own forward:
    the stage's body holds only its layers (iterated as the whole list would be), a later stage
    feeds the received hidden states as `inputs_embeds`, an earlier stage's final norm passes
    through, and only the last stage runs the output layer; masks, positions and rotary tables
    are the family's own. GPT-2 (`family="gpt2"`, no declared plan) is run block by block here."""

    def __init__(
        self, model: nn.Module, family: str, takes_tokens: bool, gives_logits: bool
    ) -> None:
        super().__init__(model)
        self.family, self.takes_tokens, self.gives_logits = family, takes_tokens, gives_logits

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if self.family == "gpt2":
            return self._gpt2(idx)
        inputs = {"input_ids": idx} if self.takes_tokens else {"inputs_embeds": idx}
        if self.gives_logits:
            return self.hf(**inputs, use_cache=False).logits
        body = getattr(self.hf, self.hf.base_model_prefix)
        return body(**inputs, use_cache=False).last_hidden_state

    def _gpt2(self, idx: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        body = self.hf.transformer
        seq = idx.shape[1]
        positions = torch.arange(seq, device=idx.device).unsqueeze(0)
        h = body.drop(body.wte(idx) + body.wpe(positions)) if self.takes_tokens else idx
        mask = create_causal_mask(
            config=body.config,
            inputs_embeds=h,
            attention_mask=None,
            cache=None,
            position_ids=positions,
        )
        for block in body.h.values():
            h = block(h, None, mask, None, use_cache=False, position_ids=positions)
        if not self.gives_logits:
            return h
        return self.hf.lm_head(body.ln_f(h))
