"""One process, one device: the reference backend the sharded ones are compared against."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bigtrain.config.schema import Config
from bigtrain.optim.optimizer import MOMENTS, fp32_optimizer_state
from bigtrain.parallel.backend import TorchBackend, checkpoint_writer, weights_fingerprint
from bigtrain.parallel.sources import LocalSource, write_local_layout
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
        """model.safetensors (weights and buffers) and optimizer.safetensors (FP32 moments by
        parameter name, step counts in its metadata) from a host copy of the state, written by the
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
        return self._writer.submit(self._write, directory, host, model, ready)

    def _write(self, directory: Path, host, model, ready) -> list[str]:
        if ready is not None:
            ready.synchronize()
        tensors = {k: host["params"][v] if isinstance(v, int) else v for k, v in model.items()}
        states = {}
        for name, i in model.items():
            state = host["optim"][i] if isinstance(i, int) else None
            if state:
                state = fp32_optimizer_state(self.optimizer, state)
                states[name] = (float(state["step"]), {k: state[k] for k in MOMENTS})
        return write_local_layout(directory, tensors, states)

    def load(self, directory: Path) -> None:
        self.load_from(LocalSource(directory), optimizer=True)

    def fingerprint(self) -> str:
        return weights_fingerprint(
            (canonical_name(n), lambda p=p: p) for n, p in self.model.named_parameters()
        )
