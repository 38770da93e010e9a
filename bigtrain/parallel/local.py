"""One process, one device: the reference backend the sharded ones are compared against."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_model, save_model
from torch import nn

from bigtrain.config.schema import OptimConfig
from bigtrain.parallel.backend import (
    adamw_param_groups,
    canonical_name,
    lm_loss,
    weights_fingerprint,
)
from bigtrain.precision.policy import PrecisionPolicy


class LocalBackend:
    name = "local"

    def __init__(
        self, model: nn.Module, policy: PrecisionPolicy, optim: OptimConfig, device: torch.device
    ) -> None:
        assert all(p.dtype == policy.master_dtype for p in model.parameters()), (
            "master weights must be built in FP32"
        )
        self.model = model.to(device)
        self.policy = policy
        self.device = device
        # fused AdamW is CUDA's fast path; on CPU foreach is the fast one (fused would JIT nothing useful).
        self.optimizer = torch.optim.AdamW(
            adamw_param_groups(self.model, optim.weight_decay),
            lr=optim.lr,
            betas=(optim.beta1, optim.beta2),
            eps=optim.eps,
            fused=device.type == "cuda",
            foreach=None if device.type == "cuda" else True,
        )

    def _autocast(self) -> torch.autocast:
        return torch.autocast(
            self.device.type, dtype=self.policy.compute_dtype, enabled=self.policy.autocast
        )

    def forward_backward(
        self, inputs: torch.Tensor, targets: torch.Tensor, loss_div: float
    ) -> torch.Tensor:
        with self._autocast():
            logits = self.model(inputs)
        loss = lm_loss(logits, targets)
        (loss / loss_div).backward()
        return loss.detach()

    @torch.no_grad()
    def eval_loss(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        self.model.eval()
        total = torch.zeros((), device=self.device)
        for inputs, targets in batches:
            with self._autocast():
                total += lm_loss(self.model(inputs), targets)
        self.model.train()
        return total / len(batches)

    def named_grads(self) -> list[tuple[str, torch.Tensor]]:
        return [
            (canonical_name(n), p.grad)
            for n, p in self.model.named_parameters()
            if p.grad is not None
        ]

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        params = [p for p in self.model.parameters() if p.grad is not None]
        if max_norm > 0:
            return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        return torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)

    def step(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.zero_grad()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def save(self, directory: Path) -> list[str]:
        save_model(self.model, str(directory / "model.safetensors"))
        torch.save(self.optimizer.state_dict(), directory / "optimizer.pt")
        return ["model.safetensors", "optimizer.pt"]

    def load(self, directory: Path) -> None:
        missing, unexpected = load_model(
            self.model, str(directory / "model.safetensors"), strict=True, device=str(self.device)
        )
        assert not missing and not unexpected, (missing, unexpected)
        # weights_only: only tensors and plain containers are unpickled, never arbitrary objects.
        state = torch.load(directory / "optimizer.pt", map_location=self.device, weights_only=True)
        self.optimizer.load_state_dict(state)

    def fingerprint(self) -> str:
        return weights_fingerprint(
            [(canonical_name(n), p) for n, p in self.model.named_parameters()]
        )
