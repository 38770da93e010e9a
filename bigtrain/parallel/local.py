"""One process, one device: the reference backend the sharded ones are compared against."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_model, save_model
from torch import nn

from bigtrain.config.schema import OptimConfig
from bigtrain.parallel.backend import TorchBackend, canonical_name, weights_fingerprint
from bigtrain.precision.policy import PrecisionPolicy


class LocalBackend(TorchBackend):
    name = "local"

    def __init__(
        self, model: nn.Module, policy: PrecisionPolicy, optim: OptimConfig, device: torch.device
    ) -> None:
        assert all(p.dtype == policy.master_dtype for p in model.parameters()), (
            "master weights must be built in FP32"
        )
        super().__init__(model.to(device), policy, optim, device)

    def save(self, directory: Path) -> None:
        save_model(self.model, str(directory / "model.safetensors"))
        torch.save(self.optimizer.state_dict(), directory / "optimizer.pt")

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
            (canonical_name(n), lambda p=p: p) for n, p in self.model.named_parameters()
        )
