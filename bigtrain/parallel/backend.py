"""The backend base class: what the loop asks of local, FSDP2 and ZeRO alike.

The loop never branches on the backend. A backend owns the wrapped model and the optimizer, runs
forward/backward under the precision policy, exposes its local gradient shards, clips, steps or
skips, and says which blocks of which parameters its tensors hold (`blocks`): from that, saving
and loading are written once here, in the one checkpoint format of every backend
(checkpoint/state.py); the checkpoint manager adds the trainer state, the atomic commit and the
manifest around `save`/`load`.
"""

from __future__ import annotations

import abc
import contextlib
import hashlib
import os
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from bigtrain.checkpoint import state as checkpoint_state
from bigtrain.checkpoint.state import Block
from bigtrain.model.loss import lm_loss
from bigtrain.optim.optimizer import (
    fp32_moments,
    fp32_optimizer_state,
    set_fp32_optimizer_state,
)
from bigtrain.parallel.layout import Layout
from bigtrain.precision.policy import Phase
from bigtrain.precision.scaler import LossScaler, ScaleUpdate
from bigtrain.utils.names import canonical_name
from bigtrain.utils.tensors import host_ready, local_tensor, to_cpu


class Backend(abc.ABC):
    """A backend owns the wrapped model and its optimizer. Subclasses implement the abstract
    methods; what all backends do alike (reductions, evaluation, host copies of the state) is
    here once. Optional abilities are declared as attributes with their default."""

    name: str
    model: nn.Module  # the module (unwrapped by the backend's engine, if any)
    device: torch.device
    scaler: LossScaler | None = None
    """bigtrain's own loss scaler, whose state travels in the trainer state; None without loss
    scaling, and on ZeRO (DeepSpeed's scaler is saved with the backend's files)."""
    layout: Layout = Layout(world_size=1)
    """Where this rank sits (parallel/layout.py); one process unless the backend is given one."""
    state_key = "params"  # local_state's key of the master tensors
    state_label = "param"  # state_tensors' name prefix

    @abc.abstractmethod
    def set_phase(self, phase: Phase) -> None:
        """Switch compute dtype and FP32 modules to a precision phase's (from the next forward)."""

    @abc.abstractmethod
    def loss_scale(self) -> float | None:
        """The current loss scale, None without loss scaling."""

    @abc.abstractmethod
    def update_loss_scale(self, overflow: bool) -> ScaleUpdate | None:
        """After the step decision: back off or grow the scale; None without loss scaling."""

    @abc.abstractmethod
    def forward_backward(
        self, inputs: torch.Tensor, targets: torch.Tensor, micro_step: int, num_micro_steps: int
    ) -> torch.Tensor:
        """Forward and backward of one micro-batch (gradients summed to the mean over the step's
        micro-batches and, on the last one, over ranks); returns this rank's detached loss."""

    @abc.abstractmethod
    def eval_logits(self, inputs: torch.Tensor) -> torch.Tensor:
        """The model's logits in its compute precision, in eval mode and without gradients (under
        the GPT's tensor parallelism a DTensor split by vocabulary: reduce it in loss_context)."""

    @abc.abstractmethod
    def named_grads(self) -> list[tuple[str, torch.Tensor]]:
        """This rank's gradient of every trainable parameter (its local shard on sharded backends;
        an empty tensor where it holds none), by canonical name, in the same order on every rank:
        the monitor's per-tensor statistics line up across ranks."""

    @abc.abstractmethod
    def unscale_grads(self) -> float:
        """Remove the loss scale from the gradients where the backend can (returns 1.0), or return
        the factor they still carry (ZeRO: DeepSpeed unscales inside its step)."""

    @abc.abstractmethod
    def clip_grads(self, max_norm: float, total_norm: torch.Tensor) -> None:
        """Scale the gradients so that their global norm `total_norm` (from the monitor's
        statistics, unscaled) is at most max_norm; nothing when max_norm is 0."""

    @abc.abstractmethod
    def step(self, lr: float) -> None:
        """Optimizer step at learning rate `lr`, then zero the gradients."""

    @abc.abstractmethod
    def skip_step(self) -> None:
        """Discard this step's gradients without touching weights or optimizer state."""

    @abc.abstractmethod
    def blocks(self, index: int, tensor: torch.Tensor) -> list[Block]:
        """The parameter blocks that master tensor `index` of master_state() holds, as views of
        `tensor`: that master's local data, or a tensor of its shape (a host copy, a moment)."""

    @abc.abstractmethod
    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every trainable parameter's whole shape, by canonical name."""

    @abc.abstractmethod
    def reset_optimizer_state(self, master: torch.Tensor) -> None:
        """The optimizer state of master tensor `master` as before its first step."""

    @abc.abstractmethod
    def fingerprint(self) -> str:
        """sha256 of the full FP32 master weights in canonical order (a collective)."""

    @abc.abstractmethod
    def master_state(self) -> tuple[list[torch.Tensor], dict]:
        """This rank's FP32 master tensors (parameters or flat partitions), and the optimizer
        state dict keyed by them."""

    @abc.abstractmethod
    def load_from(self, source: Any, optimizer: bool) -> None:
        """Load the FP32 master weights (and, with `optimizer`, the AdamW moments and step
        counts) from a source (checkpoint/sources.py: initial values, a Hugging Face
        directory), reading only the slices this rank keeps; persistent buffers too. The
        optimizer state stays fresh without `optimizer`. Checkpoints load through `load`."""

    def adopt_loss_scale(self, scale: float) -> None:  # noqa: B027 (nothing without scaling)
        """Continue from the loss scale of a checkpoint written by another backend."""

    def borrowed_rng(self, step: int) -> None:  # noqa: B027 (nothing by default)
        """This rank resumed with rank 0's RNG state (the world grew at `step`): re-derive what
        must differ per rank (the GPT's dropout masks under tensor parallelism)."""

    def after_load_local_state(self) -> None:  # noqa: B027 (optional: nothing by default)
        """What must follow new master values (ZeRO: refresh the compute-dtype copies)."""

    # Checkpoints: one format and one mechanism for every backend. The state is copied to host
    # memory now (or taken from a snapshot's copy); DCP writes it from a writer thread over a gloo
    # group of its own (on the default group its collectives would interleave with training's).
    _writer: ThreadPoolExecutor | None = None
    _spare: dict[str, Any] | None = None  # host buffers of the last checkpoint's copy
    _group: dist.ProcessGroup | None = None

    @property
    def base_optimizer(self) -> torch.optim.Optimizer:
        """The AdamW whose per-parameter state checkpoints hold (master_state()'s)."""
        return self.optimizer  # type: ignore[attr-defined]

    def extra_state(self) -> dict[str, Any]:
        """What the backend keeps beside its tensors (JSON), back to the same backend on load."""
        return {}

    def load_extra_state(self, saved: dict[str, Any]) -> None:  # noqa: B027 (nothing by default)
        """Restore what extra_state returned (it holds `loss_scale` and `backend` too)."""

    def checkpoint_group(self) -> dist.ProcessGroup | None:
        """The group checkpoints are written and read over (None in one process); made at the
        first save or load, which every rank reaches together."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return None
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        return self._group

    def save_async(
        self, directory: Path, host_state: dict[str, Any] | None = None, threads: int = 1
    ) -> Future[dict[str, str]]:
        """Write this rank's part of the model and optimizer into `directory` (shared by ranks)
        in the background: the state is copied to host memory now (or taken from `host_state`,
        what local_state returned at this step), so training may go on; the future holds the
        files this rank wrote, relative to `directory`, with their sha256 (checkpoint/state.py)."""
        if host_state is None:  # the previous save's buffers are free again (one write at a time)
            host_state = self._spare = self.local_state(into=self._spare)
        ready = host_ready(self.device)
        buffers = {k: to_cpu(v) for k, v in persistent_buffers(self.model).items()}
        group = self.checkpoint_group()
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="bigtrain-ckpt-write")
        args = (directory, host_state, buffers, ready, group, threads)
        return self._writer.submit(self._write, *args)

    def _write(self, directory: Path, host, buffers, ready, group, threads: int) -> dict[str, str]:
        if ready is not None:
            ready.synchronize()
        optim = [fp32_optimizer_state(self.base_optimizer, s) if s else None for s in host["optim"]]
        state = checkpoint_state.state_dict(self.blocks, host[self.state_key], optim, buffers)
        return checkpoint_state.write(directory, state, group, threads)

    def save(self, directory: Path, host_state: dict[str, Any] | None = None) -> dict[str, str]:
        """save_async's files, written before returning: the loop waits, so DCP writes them with
        up to 4 threads (the same bytes, in as many files per rank)."""
        threads = min(4, os.cpu_count() or 1)
        return self.save_async(directory, host_state, threads).result()

    @torch.no_grad()
    def load(self, directory: Path, optimizer: bool = True) -> None:
        """Load a checkpoint of any backend, world size or mesh (DCP reshards): the master
        weights in place, persistent buffers, and with `optimizer` the AdamW state (fresh
        without: a new run from a checkpoint's weights)."""
        masters, _ = self.master_state()
        buffers = {k: local_tensor(v) for k, v in persistent_buffers(self.model).items()}
        states = checkpoint_state.load(
            directory,
            self.blocks,
            [local_tensor(m) for m in masters],
            buffers,
            self.param_shapes(),
            optimizer,
            self.checkpoint_group(),
            [fp32_moments(self.base_optimizer, m) for m in masters] if optimizer else None,
        )
        for master, state in zip(masters, states, strict=True):
            if state is not None:
                set_fp32_optimizer_state(self.base_optimizer, master, *state)
            else:
                self.reset_optimizer_state(master)
        self.after_load_local_state()

    def reduce_mean(self, value: torch.Tensor) -> torch.Tensor:
        """Mean of a loss over the ranks that hold one (identity in one process)."""
        if self.layout.distributed:
            value = value.clone()
            if dist.get_backend() == "nccl" and self.layout.loss_ranks == self.layout.world_size:
                dist.all_reduce(value, op=dist.ReduceOp.AVG)
            else:  # gloo has no AVG; with pipeline stages only the last holds a loss
                dist.all_reduce(value, op=dist.ReduceOp.SUM)
                value /= self.layout.loss_ranks
        return value

    def loss_context(self) -> contextlib.AbstractContextManager:
        """Entered around the loss and its backward: tensor parallelism's loss over logits split
        by vocabulary (parallel/fsdp.py); nothing otherwise."""
        return contextlib.nullcontext()

    @torch.no_grad()
    def eval_loss(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Mean loss over this rank's batches and over ranks, without gradients."""
        total = torch.zeros((), device=self.device)
        for inputs, targets in batches:
            logits = self.eval_logits(inputs)
            with self.loss_context():
                total += local_tensor(lm_loss(logits, targets))
        return self.reduce_mean(total / len(batches))

    def state_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """This rank's shard of master weights and floating optimizer states, on the device (the
        finite check before a checkpoint)."""
        masters, optim_state = self.master_state()
        out = []
        for i, master in enumerate(masters):
            out.append((f"{self.state_label}{i}", local_tensor(master).detach()))
            for key, value in optim_state.get(master, {}).items():
                if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim():
                    out.append((f"{self.state_label}{i}.{key}", local_tensor(value)))
        return out

    def local_state(self, into: dict[str, Any] | None = None) -> dict[str, Any]:
        """Host copy of this rank's shard of master weights and optimizer state (snapshots,
        checkpoints), into the tensors of an earlier copy `into` where they fit."""
        masters, optim_state = self.master_state()
        state = {self.state_key: masters, "optim": [dict(optim_state.get(m, {})) for m in masters]}
        return to_cpu(state, into)

    @torch.no_grad()
    def load_local_state(self, state: dict[str, Any]) -> None:
        """Restore what local_state returned, on the same world size: in place, so the shards
        keep their storage (and DTensor layout); only values change."""
        masters, optim_state = self.master_state()
        for master, saved, saved_optim in zip(
            masters, state[self.state_key], state["optim"], strict=True
        ):
            local_tensor(master).copy_(saved)
            if not saved_optim:
                optim_state.pop(master, None)
                continue
            current = optim_state[master]
            assert set(current) == set(saved_optim), (
                "a snapshot restores onto an optimizer in the same phase"
            )
            for key, value in saved_optim.items():
                if isinstance(value, torch.Tensor):
                    local_tensor(current[key]).copy_(value)
                else:
                    current[key] = value
        self.after_load_local_state()


def weights_fingerprint(named: Iterable[tuple[str, Callable[[], torch.Tensor]]]) -> str:
    """sha256 over (name, shape, FP32 bytes) in name order: equal for equal weights whatever the
    backend or world size that held them. Tensors come from callables so that a sharded backend
    gathers one parameter at a time, in the same order on every rank."""
    h = hashlib.sha256()
    for name, get in sorted(named, key=lambda item: item[0]):
        data = get().detach().to("cpu", torch.float32).contiguous()
        h.update(f"{name}:{tuple(data.shape)};".encode())
        h.update(data.numpy().tobytes())
    return h.hexdigest()


def scale_to_norm(grads: list[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    """Clip: scale the local gradient shards in place so that the global norm `total_norm` (the
    monitor's, over every rank) is at most max_norm (nothing when it is 0). One foreach call, no
    host sync: the coefficient stays on the device."""
    grads = [g for g in grads if g.numel()]
    if max_norm > 0 and grads:
        torch._foreach_mul_(grads, (max_norm / (total_norm + 1e-6)).clamp(max=1.0))


@torch.no_grad()
def load_buffers(model: nn.Module, source: Any) -> None:
    """The model's persistent buffers that the source holds."""
    for name, buffer in persistent_buffers(model).items():
        value = source.buffer(name)
        if value is not None:
            local_tensor(buffer).copy_(value.view(buffer.shape))


def persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's buffers that belong in a checkpoint, by canonical name."""
    out = {}
    for module_name, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and name not in module._non_persistent_buffers_set:
                out[canonical_name(f"{module_name}.{name}" if module_name else name)] = buffer
    return out
