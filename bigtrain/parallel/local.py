"""One process, one device: the reference backend the sharded ones are compared against."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from bigtrain.config.schema import Config
from bigtrain.errors import ConfigError
from bigtrain.parallel.backend import (
    TorchBackend,
    checkpoint_writer,
    fp32_optimizer_state,
    weights_fingerprint,
)
from bigtrain.precision.policy import PrecisionPolicy
from bigtrain.utils.names import canonical_name
from bigtrain.utils.tensors import host_ready, local_tensor, to_cpu


class LocalBackend(TorchBackend):
    name = "local"

    def __init__(
        self, model: nn.Module, policy: PrecisionPolicy, cfg: Config, device: torch.device
    ) -> None:
        assert all(p.dtype == policy.master_dtype for p in model.parameters()), (
            "master weights must be built in FP32"
        )
        super().__init__(model.to(device), policy, cfg, device)
        self._writer = checkpoint_writer()
        self._spare: dict[str, Any] | None = None  # host buffers of the last checkpoint's copy

    def _canonical_state(self) -> dict[str, torch.Tensor]:
        """The model's tensors by canonical name, each storage once (tied weights share one), so a
        checkpoint loads whether or not compile or activation checkpointing wrap the blocks."""
        out, seen = {}, set()
        for key, value in self.model.state_dict().items():
            if value.untyped_storage().data_ptr() not in seen:
                seen.add(value.untyped_storage().data_ptr())
                out[canonical_name(key)] = value.detach().contiguous()
        return out

    def save_async(
        self, directory: Path, host_state: dict[str, Any] | None = None
    ) -> Future[list[str]]:
        """model.safetensors and optimizer.pt from a host copy of the state, written by the
        writer thread (sync saves wait for it: both paths write the same bytes)."""
        if host_state is None:  # the previous save's buffers are free again (one write at a time)
            host_state = self._spare = self.local_state(into=self._spare)
        host, ready = host_state, host_ready(self.device)
        index = {
            local_tensor(p).untyped_storage().data_ptr(): i for i, p in enumerate(self._params())
        }
        model: dict[str, int | torch.Tensor] = {}  # name -> index into host params, or a copy
        for name, tensor in self._canonical_state().items():
            i = index.get(tensor.untyped_storage().data_ptr())
            model[name] = i if i is not None else to_cpu(tensor)  # buffers, frozen weights
        groups = torch.optim.Optimizer.state_dict(self.optimizer)["param_groups"]
        return self._writer.submit(self._write, directory, host, model, groups, ready)

    def _write(self, directory: Path, host, model, groups, ready) -> list[str]:
        if ready is not None:
            ready.synchronize()
        tensors = {k: host["params"][v] if isinstance(v, int) else v for k, v in model.items()}
        save_file(tensors, str(directory / "model.safetensors"))
        state = {
            i: fp32_optimizer_state(self.optimizer, s) for i, s in enumerate(host["optim"]) if s
        }
        torch.save({"state": state, "param_groups": groups}, directory / "optimizer.pt")
        return ["model.safetensors", "optimizer.pt"]

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
