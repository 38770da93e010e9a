"""The local and FSDP2 backends over a pipeline rank's chunks: what a backend does that depends
on the model being split into stages, in one place (the rest is the backend's own).

The step goes through the schedule (schedule.py); evaluation and samples through the stages in
order; the monitor, the checkpoint and the fingerprint see the whole model's parameters by name
(`monitored`, `param_shapes`, `named_grads`, `fingerprint`); a tied table's second copy on one
rank is saved once and copied back after a load.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from bigtrain.checkpoint.state import Block
from bigtrain.parallel.backends.fsdp import FSDPBackend
from bigtrain.parallel.backends.local import LocalBackend
from bigtrain.parallel.pipeline.schedule import Pipeline
from bigtrain.parallel.tensor.plans import uses_gpt_plan


class Pipelined:
    """Mixed in before LocalBackend or FSDPBackend (their model: the Pipeline's StageChunks)."""

    pipeline: Pipeline

    def forward_backward(
        self, inputs: torch.Tensor, targets: torch.Tensor, micro_step: int, num_micro_steps: int
    ) -> torch.Tensor:
        scale = self.scaler.scale if self.scaler else 1.0  # type: ignore[attr-defined]
        return self.pipeline.step(
            inputs, targets, scale, micro_step, num_micro_steps, self._step_context
        )

    @contextlib.contextmanager
    def _step_context(self) -> Iterator[None]:
        """Around a schedule's step: autocast for the forwards, the loss context for the loss
        and the backwards."""
        with self.autocast(), self.loss_context():  # type: ignore[attr-defined]
            yield

    @torch.no_grad()
    def eval_loss(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        total = torch.zeros((), device=self.device)  # type: ignore[attr-defined]
        for inputs, targets in batches:
            total += self.pipeline.eval_loss(
                inputs,
                targets,
                self.autocast,
                self.loss_context,  # type: ignore[attr-defined]
            )
        return self.reduce_mean(total / len(batches))  # type: ignore[attr-defined]

    def eval_logits(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.pipeline.logits(inputs, self.autocast)  # type: ignore[attr-defined]

    def named_grads(self) -> list[tuple[str, torch.Tensor]]:
        return self.pipeline.named_grads()

    def monitored(self) -> tuple[list[str], list[int]]:
        return self.pipeline.whole_names, self.pipeline.replication()

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every trainable parameter of the whole model: every rank checks every one alike."""
        names = set(self.pipeline.whole_names)
        return {n: s for n, s in self.pipeline.whole_shapes.items() if n in names}

    def islands_whole(self) -> nn.Module:
        return self.pipeline.whole

    def blocks(self, index: int, tensor: torch.Tensor) -> list[Block]:
        if self.pipeline.local_copy(self._params()[index]):  # type: ignore[attr-defined]
            return []  # the tied table's second copy on this rank: the first one is saved
        return super().blocks(index, tensor)  # type: ignore[misc]

    def after_load_local_state(self) -> None:
        self.pipeline.load_local_copies(self.optimizer)  # type: ignore[attr-defined]

    def fingerprint(self) -> str:
        return self.pipeline.fingerprint()


class PipelinedLocal(Pipelined, LocalBackend):
    """One process per pipeline stage, each holding its chunks whole."""

    def __init__(self, pipeline: Pipeline, *backend_args: Any) -> None:
        """`backend_args`: LocalBackend's after the model (policy, optim, precision, device)."""
        self.pipeline = pipeline
        self.layout = pipeline.layout  # one process per stage: not alone
        super().__init__(pipeline.root, *backend_args)


class PipelinedFSDP(Pipelined, FSDPBackend):
    """Each of the pipeline rank's chunks fully sharded over its stage's ranks."""

    def __init__(self, pipeline: Pipeline, *backend_args: Any) -> None:
        """`backend_args`: FSDPBackend's after the model (policy, optim, precision, device,
        layout, seed)."""
        self.pipeline = pipeline
        super().__init__(pipeline.root, *backend_args)
        # bigtrain's GPT plan leaves the last stage's logits split by vocabulary
        self.logits_split_by_vocab = self.layout.tp > 1 and uses_gpt_plan(pipeline.root.chunks[0])
