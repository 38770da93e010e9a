"""The backend protocol: what the loop asks of local, FSDP2 and ZeRO alike.

The loop never branches on the backend. A backend owns the wrapped model and the optimizer, runs
forward/backward under the precision policy, exposes its local gradients, clips, steps, and saves
and loads its own tensors; the checkpoint manager adds the trainer state, the atomic commit and
the manifest around `save`/`load`.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, computed in FP32 whatever the compute dtype."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


class Backend(Protocol):
    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer

    def forward_backward(
        self, inputs: torch.Tensor, targets: torch.Tensor, loss_div: float
    ) -> torch.Tensor:
        """Forward under autocast, backward of loss / loss_div; returns the detached loss."""

    def eval_loss(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Mean loss over batches, no grad, averaged over ranks; a device tensor."""

    def named_grads(self) -> list[tuple[str, torch.Tensor]]:
        """This rank's gradient tensors (local shards on sharded backends), by canonical name."""

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Global gradient norm before clipping (a device tensor); clips when max_norm > 0."""

    def step(self, lr: float) -> None:
        """Optimizer step at learning rate `lr`, then zero the gradients."""

    def zero_grad(self) -> None: ...

    def save(self, directory: Path) -> list[str]:
        """Write this backend's tensors into `directory`; returns the file names written."""

    def load(self, directory: Path) -> None:
        """Load what `save` wrote (possibly at another world size, where the backend reshards)."""

    def fingerprint(self) -> str:
        """sha256 of the full FP32 master weights in canonical (name-sorted) order."""


def canonical_name(name: str) -> str:
    """Parameter names without wrapper prefixes (compile, DDP, DeepSpeed), so fingerprints and
    telemetry agree across backends."""
    for prefix in ("_orig_mod.", "module."):
        name = name.replace(prefix, "")
    return name


def weights_fingerprint(named_tensors: list[tuple[str, torch.Tensor]]) -> str:
    """sha256 over (name, shape, FP32 bytes) in name order: equal for equal weights whatever the
    backend or world size that held them."""
    h = hashlib.sha256()
    for name, tensor in sorted(named_tensors, key=lambda item: item[0]):
        data = tensor.detach().to("cpu", torch.float32).contiguous()
        h.update(f"{name}:{tuple(data.shape)};".encode())
        h.update(data.numpy().tobytes())
    return h.hexdigest()


def adamw_param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices (linear weights, embeddings), not biases or norm gains."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
