"""One process, one device: the reference backend the sharded ones are compared against."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from bigtrain.config.schema import Config
from bigtrain.errors import ConfigError
from bigtrain.parallel.backend import TorchBackend, canonical_name, weights_fingerprint
from bigtrain.precision.policy import PrecisionPolicy


class LocalBackend(TorchBackend):
    name = "local"

    def __init__(
        self, model: nn.Module, policy: PrecisionPolicy, cfg: Config, device: torch.device
    ) -> None:
        assert all(p.dtype == policy.master_dtype for p in model.parameters()), (
            "master weights must be built in FP32"
        )
        super().__init__(model.to(device), policy, cfg, device)

    def _canonical_state(self) -> dict[str, torch.Tensor]:
        """The model's tensors by canonical name, each storage once (tied weights share one), so a
        checkpoint loads whether or not compile or activation checkpointing wrap the blocks."""
        out, seen = {}, set()
        for key, value in self.model.state_dict().items():
            if value.untyped_storage().data_ptr() not in seen:
                seen.add(value.untyped_storage().data_ptr())
                out[canonical_name(key)] = value.detach().contiguous()
        return out

    def save(self, directory: Path) -> None:
        save_file(self._canonical_state(), str(directory / "model.safetensors"))
        torch.save(self.optimizer.state_dict(), directory / "optimizer.pt")

    @torch.no_grad()
    def load(self, directory: Path) -> None:
        saved = load_file(str(directory / "model.safetensors"), device=str(self.device))
        expected = self._canonical_state()
        if set(saved) != set(expected):
            raise ConfigError(
                f"checkpoint '{directory}': model tensors differ from this model's "
                f"(missing {sorted(set(expected) - set(saved))[:5]}, unexpected {sorted(set(saved) - set(expected))[:5]})"
            )
        for name, tensor in expected.items():
            tensor.copy_(saved[name])
        # weights_only: only tensors and plain containers are unpickled, never arbitrary objects.
        state = torch.load(directory / "optimizer.pt", map_location=self.device, weights_only=True)
        self.optimizer.load_state_dict(state)

    def fingerprint(self) -> str:
        return weights_fingerprint(
            (canonical_name(n), lambda p=p: p) for n, p in self.model.named_parameters()
        )
