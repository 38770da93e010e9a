"""The backend base class: what the loop asks of local, FSDP2 and ZeRO alike.

The loop never branches on the backend. A backend owns the wrapped model and the optimizer, runs
forward/backward under the precision policy, exposes its local gradient shards, clips, steps or
skips, and says which blocks of which parameters its tensors hold (`blocks`, `master_state`):
checkpoint/ reads and writes them, in the one checkpoint format of every backend
(checkpoint/state_io.py, for the checkpoint manager).
"""

from __future__ import annotations

import abc
import contextlib
import hashlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from bigtrain.checkpoint.state import Block
from bigtrain.checkpoint.state_io import persistent_buffers
from bigtrain.model.loss import lm_loss
from bigtrain.parallel.layout import Layout
from bigtrain.precision.policy import Phase
from bigtrain.precision.scaler import LossScaler, ScaleUpdate
from bigtrain.utils.names import canonical_name
from bigtrain.utils.tensors import local_tensor, plain_tensor, to_cpu


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
        micro-batches and, on the last one, over ranks); returns this rank's detached loss. Both
        run inside `model.moe.aux_grad_scale(model, factor)`, `factor` the loss's own multiplier
        (an MoE layer's auxiliary losses take it to their backward; without it, backward raises)."""

    @abc.abstractmethod
    def eval_logits(self, inputs: torch.Tensor) -> torch.Tensor:
        """The model's logits in its compute precision, in eval mode and without gradients (under
        the GPT's tensor parallelism a DTensor split by vocabulary: reduce it in loss_context;
        under context parallelism this rank's chunks: whole_sequence gathers them)."""

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
        optimizer state stays fresh without `optimizer`. Checkpoints load through checkpoint/
        (CheckpointManager.load)."""

    def monitored(self) -> tuple[list[str], list[int]]:
        """The names of named_grads (the same list on every rank) and, per name, over how many
        ranks this rank's gradient of it is repeated (the monitor counts each tensor once)."""
        trainable = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        return [canonical_name(n) for n, _ in trainable], [
            self.layout.replication(p) for _, p in trainable
        ]

    def adopt_loss_scale(self, scale: float) -> None:  # noqa: B027 (nothing without scaling)
        """Continue from the loss scale of a checkpoint written by another backend."""

    def borrowed_rng(self, step: int) -> None:  # noqa: B027 (nothing by default)
        """This rank resumed with rank 0's RNG state (the world grew at `step`): re-derive what
        must differ per rank (the GPT's dropout masks under tensor parallelism)."""

    def after_load_local_state(self) -> None:  # noqa: B027 (optional: nothing by default)
        """What must follow new master values (ZeRO: refresh the compute-dtype copies)."""

    @property
    def base_optimizer(self) -> torch.optim.Optimizer:
        """The AdamW whose per-parameter state checkpoints hold (master_state()'s)."""
        return self.optimizer  # type: ignore[attr-defined]

    def extra_state(self) -> dict[str, Any]:
        """What the backend keeps beside its tensors (JSON), back to the same backend on load."""
        return {}

    def load_extra_state(self, saved: dict[str, Any]) -> None:  # noqa: B027 (nothing by default)
        """Restore what extra_state returned (it holds `loss_scale` and `backend` too)."""

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

    def whole_sequence(self, logits: torch.Tensor) -> torch.Tensor:
        """eval_logits' result over every position: under context parallelism gathered from the
        cp ranks (a collective), else as it is."""
        split = self.layout.context_split()
        return logits if split is None else split.gather(logits)

    def loss_context(self) -> contextlib.AbstractContextManager:
        """Entered around the loss and its backward: tensor parallelism's loss over logits split
        by vocabulary (parallel/backends/fsdp.py); nothing otherwise."""
        return contextlib.nullcontext()

    @torch.no_grad()
    def eval_loss(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Mean loss over this rank's batches and over ranks, without gradients."""
        total = torch.zeros((), device=self.device)
        for inputs, targets in batches:
            logits = self.eval_logits(inputs)
            with self.loss_context():
                total += local_tensor(lm_loss(logits, self.layout.own_tokens(targets)))
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
        hash_tensor(h, name, get())
    return h.hexdigest()


def hash_tensor(h: Any, name: str, tensor: torch.Tensor) -> None:
    """One parameter into a weights_fingerprint hash: (name, shape, FP32 bytes)."""
    data = plain_tensor(tensor.detach()).to("cpu", torch.float32).contiguous()
    h.update(f"{name}:{tuple(data.shape)};".encode())
    h.update(data.numpy().tobytes())


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
