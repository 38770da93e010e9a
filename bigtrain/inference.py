"""`bigtrain generate CKPT_OR_RUN_DIR`: text from a checkpoint of any backend and world size, in
one process.

A run directory means its newest committed checkpoint. checkpoint/ opens it
(checkpoint/export.py `open_saved_model`: verified, its own config.yaml says which model it holds,
its tokenizer/ encodes the prompts as training encoded text, the weights stream into the model
built on the host in FP32), which then moves to the device. bigtrain's GPT decodes with its KV cache, a model.kind=hf model with transformers'
`generate` (model/generate.py). Prompts run one at a time, each with a generator of its own seeded
with `seed`: a prompt's text does not depend on the prompts before it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bigtrain.checkpoint.export import open_saved_model
from bigtrain.config import Config, PrecisionConfig
from bigtrain.data.prepare.cache import load_tokenizer
from bigtrain.errors import ConfigError
from bigtrain.model import num_params
from bigtrain.model.generate import (
    Generation,
    Sample,
    Sampling,
    as_sample,
    cached_step,
    decode,
    encode_prompt,
    generate_hf,
    last_document,
)
from bigtrain.model.gpt import GPT
from bigtrain.parallel.env import DistEnv, pick_device
from bigtrain.precision import apply_to_model, detect_hardware, resolve_policy
from bigtrain.precision.policy import DTYPES

logger = logging.getLogger(__name__)


@dataclass
class CheckpointModel:
    """A checkpoint's model in eval mode on `device`, with its tokenizer and config."""

    path: Path
    step: int
    cfg: Config
    model: nn.Module
    tokenizer: Any
    device: torch.device
    compute_dtype: torch.dtype

    @property
    def max_len(self) -> int:
        """Positions the model has: model.seq_len for the GPT (its position tables), the
        transformers config's own limit for a model.kind=hf model where it states one."""
        if isinstance(self.model, GPT):
            return self.cfg.model.seq_len
        hf_config = self.model.hf.config  # type: ignore[union-attr]
        limit = getattr(hf_config, "max_position_embeddings", None)
        return limit or getattr(hf_config, "n_positions", None) or self.cfg.model.seq_len

    def generate(self, prompts: list[str], sampling: Sampling, seed: int = 0) -> Iterator[Sample]:
        """One sample per prompt, as each is done (an empty prompt starts a new document)."""
        for number, prompt in enumerate(prompts, start=1):
            ids = encode_prompt(self.tokenizer, prompt)
            generation = self._generate(self._context(ids, number), sampling, seed)
            yield as_sample(self.tokenizer, prompt, ids, generation)

    def _context(self, ids: list[int], number: int) -> list[int]:
        """What the model reads of a prompt: under data.document_mask, its last document."""
        if self.cfg.data.document_mask:
            ids = last_document(ids, self.tokenizer.eos_token_id)
        if len(ids) > self.max_len:
            raise ConfigError(
                f"prompt {number} encodes to {len(ids)} tokens, more than the model's "
                f"{self.max_len} positions (model.seq_len): expected a shorter prompt"
            )
        return ids

    @torch.no_grad()
    def _generate(self, ids: list[int], sampling: Sampling, seed: int) -> Generation:
        prompt = torch.tensor([ids], device=self.device)
        eos_id = self.tokenizer.eos_token_id
        low_precision = self.compute_dtype != torch.float32
        with torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=low_precision):
            if isinstance(self.model, GPT):
                generator = torch.Generator(device=self.device).manual_seed(seed)
                step = cached_step(self.model)
                return decode(step, prompt, sampling, eos_id, self.max_len, generator)
            return generate_hf(self.model, prompt, sampling, eos_id, self.max_len, seed)  # type: ignore[arg-type]


def load_checkpoint_model(path: Path, device: str = "auto", dtype: str = "auto") -> CheckpointModel:
    """The model of checkpoint `path` (or of a run directory's newest), verified, on `device`
    (`auto`: CUDA when there is one); `dtype`: `auto` (FP32 on the CPU, the checkpoint's
    precision policy on a GPU), `fp32`, `bf16` or `fp16`."""
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "device 'cuda' asked for, but no CUDA device is visible (use auto or cpu)"
        )
    on = pick_device(device, DistEnv())
    saved = open_saved_model(path)
    if saved.tokenizer_dir is None:
        raise ConfigError(
            f"checkpoint '{saved.path}' has no tokenizer/ directory (expected the one every run's "
            "checkpoints carry, to encode the prompts)"
        )
    model, cfg = saved.model(), saved.cfg
    compute_dtype, reason = _compute_dtype(cfg.precision, model, on, dtype)
    logger.info(
        "generate: %s (step %d, %.2fM parameters) on %s in %s: %s",
        saved.path,
        saved.step,
        num_params(model) / 1e6,
        on,
        str(compute_dtype).removeprefix("torch."),
        reason,
    )
    tokenizer = load_tokenizer(str(saved.tokenizer_dir))
    model = model.to(on).eval()
    return CheckpointModel(saved.path, saved.step, cfg, model, tokenizer, on, compute_dtype)


def _compute_dtype(
    precision: PrecisionConfig, model: nn.Module, device: torch.device, choice: str
) -> tuple[torch.dtype, str]:
    """The dtype generation computes in, and why."""
    if choice != "auto":
        return DTYPES[choice], "as asked"
    if device.type != "cuda":
        return torch.float32, "auto: FP32 on the CPU"
    policy = resolve_policy(precision, detect_hardware(device), num_params(model))
    apply_to_model(model, policy)  # FP32 softmax where training had it
    return policy.compute_dtype, f"auto: the checkpoint's policy ({policy.reasons['compute']})"
