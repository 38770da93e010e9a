"""A backend's tensors to and from the one format (state.py): the host copy, the writer thread,
the gloo group DCP works over, and the load into the backend's own tensors.

The backend hands over what it holds (`Holder`: its master tensors and optimizer state, which
blocks of which parameters they are, its model's buffers); reading and writing is done here, once
for every backend. One `StateIO` per run, owned by the checkpoint manager.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from bigtrain.checkpoint import state as checkpoint_state
from bigtrain.checkpoint.state import Block
from bigtrain.optim.optimizer import fp32_moments, fp32_optimizer_state, set_fp32_optimizer_state
from bigtrain.utils.names import canonical_name
from bigtrain.utils.tensors import host_ready, local_tensor, to_cpu


class Holder(Protocol):
    """What a backend tells about the tensors it holds (parallel/backends/base.py implements it)."""

    model: nn.Module
    device: torch.device
    state_key: str  # local_state's key of the master tensors

    @property
    def base_optimizer(self) -> torch.optim.Optimizer: ...

    def master_state(self) -> tuple[list[torch.Tensor], dict]: ...

    def local_state(self, into: dict[str, Any] | None = None) -> dict[str, Any]: ...

    def blocks(self, index: int, tensor: torch.Tensor) -> list[Block]: ...

    def param_shapes(self) -> dict[str, tuple[int, ...]]: ...

    def reset_optimizer_state(self, master: torch.Tensor) -> None: ...

    def after_load_local_state(self) -> None: ...


def persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's buffers that belong in a checkpoint, by canonical name."""
    out = {}
    for module_name, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and name not in module._non_persistent_buffers_set:
                out[canonical_name(f"{module_name}.{name}" if module_name else name)] = buffer
    return out


class StateIO:
    """Saves and loads a holder's tensors. The state is copied to host memory at the save (or
    taken from a snapshot's copy); DCP writes it from a writer thread over a gloo group of its
    own (on the default group its collectives would interleave with training's)."""

    def __init__(self) -> None:
        self._writer: ThreadPoolExecutor | None = None
        self._spare: dict[str, Any] | None = None  # host buffers of the last save's copy
        self._group: dist.ProcessGroup | None = None

    def group(self) -> dist.ProcessGroup | None:
        """The group checkpoints are written and read over (None in one process); made at the
        first save or load, which every rank reaches together."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return None
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        return self._group

    def save_async(
        self,
        holder: Holder,
        directory: Path,
        host_state: dict[str, Any] | None = None,
        threads: int = 1,
    ) -> Future[dict[str, str]]:
        """Write this rank's part of the model and optimizer into `directory` (shared by ranks)
        in the background: the state is copied to host memory now (or taken from `host_state`,
        what local_state returned at this step), so training may go on; the future holds the
        files this rank wrote, relative to `directory`, with their sha256 (state.py)."""
        if host_state is None:  # the previous save's buffers are free again (one write at a time)
            host_state = self._spare = holder.local_state(into=self._spare)
        ready = host_ready(holder.device)
        buffers = {k: to_cpu(v) for k, v in persistent_buffers(holder.model).items()}
        group = self.group()
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="bigtrain-ckpt-write")
        args = (holder, directory, host_state, buffers, ready, group, threads)
        return self._writer.submit(_write, *args)

    def save(
        self, holder: Holder, directory: Path, host_state: dict[str, Any] | None = None
    ) -> dict[str, str]:
        """save_async's files, written before returning: the loop waits, so DCP writes them with
        up to 4 threads (the same bytes, in as many files per rank)."""
        threads = min(4, os.cpu_count() or 1)
        return self.save_async(holder, directory, host_state, threads).result()

    @torch.no_grad()
    def load(self, holder: Holder, directory: Path, optimizer: bool = True) -> None:
        """Load a checkpoint of any backend, world size or mesh (DCP reshards): the master
        weights in place, persistent buffers, and with `optimizer` the AdamW state (fresh
        without: a new run from a checkpoint's weights)."""
        masters, _ = holder.master_state()
        base = holder.base_optimizer
        buffers = {k: local_tensor(v) for k, v in persistent_buffers(holder.model).items()}
        states = checkpoint_state.load(
            directory,
            holder.blocks,
            [local_tensor(m) for m in masters],
            buffers,
            holder.param_shapes(),
            optimizer,
            self.group(),
            [fp32_moments(base, m) for m in masters] if optimizer else None,
        )
        for master, state in zip(masters, states, strict=True):
            if state is not None:
                set_fp32_optimizer_state(base, master, *state)
            else:
                holder.reset_optimizer_state(master)
        holder.after_load_local_state()


def _write(
    holder: Holder, directory: Path, host, buffers, ready, group, threads: int
) -> dict[str, str]:
    if ready is not None:
        ready.synchronize()
    base = holder.base_optimizer
    optim = [fp32_optimizer_state(base, s) if s else None for s in host["optim"]]
    state = checkpoint_state.state_dict(holder.blocks, host[holder.state_key], optim, buffers)
    return checkpoint_state.write(directory, state, group, threads)
