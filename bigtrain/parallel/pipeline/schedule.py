"""Pipeline stages at run time: this rank's model chunks, their torch.distributed.pipelining
stages and schedule, and what the rest of bigtrain asks of a model that no rank holds whole.

A rank holds one chunk (gpipe, 1f1b) or several (interleaved_1f1b: stages r, r + pp, ...; zbv:
stages r and 2 pp - 1 - r), each a pruned copy of the whole model (split.py) under one
root module, `StageChunks`, whose `pp_chunk<v>` name components canonical names drop: every
parameter keeps the whole model's name. So checkpoints are the universal format, and the
monitor's per-tensor statistics line up on every rank: `named_grads` lists every trainable
parameter of the whole model in its order, with an empty gradient where the rank holds none, and
the monitor's one SUM all-reduce over the world then makes the global norm, the non-finite
counts and each tensor's statistics the whole model's on every rank. One verdict everywhere:
replay, skip, rollback and the loss-scale update are agreed across stages with no collective of
their own.

Each accumulation micro-step runs one schedule step over train.micro_batch_size sequences split
into parallel.pp_microbatches; the loss of each pipeline micro-batch is scaled by the loss scale
/ (micro-steps x micro-batches) before its backward, so gradients are those of the mean loss, as
on every backend. Every stage reads the same batch (a memory-mapped slice, so the data cursor is
the same on every rank for checkpoints and rollbacks): the first stage feeds the inputs, the last
the targets; no labels travel between stages.

A model with tied embeddings keeps the table on the first and the last stage; after the last
micro-step their gradients are summed (one all-reduce over the two stages' ranks), so both
copies take the same step and stay equal. The monitor, the checkpoint and the fingerprint count
the first stage's copy only.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from bigtrain.model.gpt import GPT
from bigtrain.model.hf_routers import routing_layers
from bigtrain.model.loss import lm_loss
from bigtrain.model.moe import aux_grad_scale
from bigtrain.parallel.layout import Layout
from bigtrain.parallel.meta_init import shared_params
from bigtrain.utils.names import canonical_name
from bigtrain.utils.tensors import local_tensor

SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "zbv": "ScheduleZBVZeroBubble",
}
"""parallel.pp_schedule -> torch.distributed.pipelining's schedule class. That package is imported
when a pipeline is built, not with this module: it brings torch._dynamo (~0.5 s of every
process's start, pipelined or not)."""


def rank_stages(schedule: str, pp: int, chunks: int, pp_rank: int) -> list[int]:
    """The stage indices pipeline rank `pp_rank` runs, in its chunk order: loop style (r, r + pp,
    ...) for every schedule but zbv, whose V puts stages r and 2 pp - 1 - r on rank r."""
    if schedule == "zbv":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + v * pp for v in range(chunks)]


def stage_rank(schedule: str, pp: int, chunks: int, stage: int) -> int:
    """The pipeline rank that runs `stage` (rank_stages inverted)."""
    return next(r for r in range(pp) if stage in rank_stages(schedule, pp, chunks, r))


class StageChunks(nn.Module):
    """This rank's model chunks under one root, as `pp_chunk<v>` (dropped from canonical names).
    It is never called: the schedule runs the chunks."""

    def __init__(self, chunks: list[nn.Module]) -> None:
        super().__init__()
        for v, chunk in enumerate(chunks):
            self.add_module(f"pp_chunk{v}", chunk)

    @property
    def chunks(self) -> list[nn.Module]:
        return list(self.children())  # type: ignore[arg-type]

    @property
    def init_value(self) -> Callable[..., torch.Tensor]:
        """GPT.init_value of the chunk that holds a name (a rollback to the initial weights);
        absent (AttributeError) for chunks without one (transformers models)."""
        if not all(isinstance(c, GPT) for c in self.chunks):
            raise AttributeError("init_value")
        return self._init_value

    def _init_value(
        self, name: str, shape: torch.Size, device: torch.device, generator: torch.Generator
    ) -> torch.Tensor:
        owner = name.rpartition(".")[0]
        for chunk in self.chunks:
            with contextlib.suppress(AttributeError):
                chunk.get_submodule(owner)
                return chunk.init_value(name, shape, device, generator)
        raise KeyError(f"{name}: no chunk of this pipeline rank holds it")

    def forward(self, *args, **kwargs):  # noqa: ARG002
        raise RuntimeError("a pipeline rank's chunks run through its schedule (Pipeline.step)")


class Pipeline:
    """The schedule over this rank's chunks and what depends on the split (module docstring)."""

    def __init__(
        self,
        root: StageChunks,
        stages: list[int],
        num_stages: int,
        schedule: str,
        microbatches: int,
        layout: Layout,
        device: torch.device,
        whole: nn.Module,
        stage_of: dict[str, int],
    ) -> None:
        """`stages`: the stage index of each chunk of `root`; `whole`: the unsplit model (names,
        shapes and the tied table of every parameter; moved to the meta device after this, if
        it is not there already); `stage_of`: the stage holding the counted copy of each
        parameter."""
        self.root, self.layout, self.device, self.whole = root, layout, device, whole
        self.stage_ids, self.num_stages, self.schedule_name = stages, num_stages, schedule
        self.microbatches, self.stage_of = microbatches, stage_of
        self.group = layout.group("pp")
        self.first = 0 in stages
        self.last = num_stages - 1 in stages
        import torch.distributed.pipelining as pipelining

        self.stages = [
            pipelining.PipelineStage(chunk, s, num_stages, device, group=self.group)
            for chunk, s in zip(root.chunks, stages, strict=True)
        ]
        cls = getattr(pipelining, SCHEDULES[schedule])
        target = self.stages if len(self.stages) > 1 or schedule == "zbv" else self.stages[0]
        self.schedule = cls(target, microbatches, loss_fn=self._loss, scale_grads=False)
        self._factor, self._ready = 1.0, False
        self.whole_names = [
            canonical_name(n) for n, p in whole.named_parameters() if p.requires_grad
        ]
        self.whole_shapes = {canonical_name(n): tuple(p.shape) for n, p in whole.named_parameters()}
        self._tied = self._tied_copies(whole)
        self.owned = self._owned_params()
        self._tied_group = _tied_group(layout, schedule, num_stages) if self._tied_all else None

    # --- the step ------------------------------------------------------------------------------

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return lm_loss(logits, self.layout.own_tokens(targets)) * self._factor

    def step(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        scale: float,
        micro_step: int,
        num_micro_steps: int,
        context: Callable[[], contextlib.AbstractContextManager],
    ) -> torch.Tensor:
        """One accumulation micro-step through the pipeline (gradients summed into .grad);
        this rank's mean loss over the micro-batches on the last stage, 0 elsewhere."""
        if not self._ready:
            self._warm_up(inputs, targets, context)
        self._factor = scale / (num_micro_steps * self.microbatches)
        losses: list[torch.Tensor] = []
        with context(), aux_grad_scale(self.root, self._factor):  # MoE losses scaled alike
            self.schedule.step(
                *((inputs,) if self.first else ()),
                target=targets if self.last else None,
                losses=losses if self.last else None,
                return_outputs=False,
            )
        if micro_step == num_micro_steps - 1:
            self._sum_tied_grads()
        if not self.last:
            return torch.zeros((), device=self.device)
        assert len(losses) == self.microbatches, "one loss per pipeline micro-batch"
        return local_tensor(torch.stack([x.detach() for x in losses]).mean()) / self._factor

    def _warm_up(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        context: Callable[[], contextlib.AbstractContextManager],
    ) -> None:
        """torch's stages learn the shapes they exchange in their first schedule step, by a real
        forward and backward whose gradients stay behind on a module FSDP2 does not shard: that
        step is run once on the first batch and thrown away (gradients dropped, RNG restored),
        so the first real step is like every other. Evaluation never goes through the schedule
        (`forward`), so it is not inferred again."""
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            self._factor = 0.0
            with context(), aux_grad_scale(self.root, self._factor):
                self.schedule.step(
                    *((inputs,) if self.first else ()),
                    target=targets if self.last else None,
                    return_outputs=False,
                )
        for chunk in self.root.chunks:
            chunk.zero_grad(set_to_none=True)
            for layer in routing_layers(chunk):  # nor do its routers' counts
                layer.stats.zero_()
        self._ready = True

    @torch.no_grad()
    def eval_loss(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        context: Callable[[], contextlib.AbstractContextManager],
        loss_context: Callable[[], contextlib.AbstractContextManager],
    ) -> torch.Tensor:
        """The mean loss of one batch, forward only, on the last stage's ranks (0 elsewhere)."""
        logits = self.forward(inputs, context)
        if logits is None:
            return torch.zeros((), device=self.device)
        with loss_context():
            return local_tensor(lm_loss(logits, self.layout.own_tokens(targets)))

    @torch.no_grad()
    def logits(
        self, inputs: torch.Tensor, context: Callable[[], contextlib.AbstractContextManager]
    ) -> torch.Tensor:
        """The whole model's logits of `inputs` on every rank (forward's, sent from the last
        stage to every rank of the pipeline group); under tensor parallelism each tp rank gets
        its vocabulary part."""
        last = stage_rank(
            self.schedule_name, self.layout.pp, len(self.stage_ids), self.num_stages - 1
        )
        return self._broadcast(self.forward(inputs, context), last)

    @torch.no_grad()
    def forward(
        self, inputs: torch.Tensor, context: Callable[[], contextlib.AbstractContextManager]
    ) -> torch.Tensor | None:
        """The stages one after the other on the whole batch, in eval mode, each sending its
        output to the next stage's rank: the logits on the last stage's rank, None on the
        others. For evaluation and samples (any batch size, outside the schedule)."""
        hidden: torch.Tensor | None = inputs
        pp_rank, previous = self.layout.coord("pp"), 0
        for s in range(self.num_stages):
            owner = stage_rank(self.schedule_name, self.layout.pp, len(self.stage_ids), s)
            if owner != previous:
                hidden = self._pass(hidden, previous, owner)
            previous = owner
            if pp_rank == owner:
                chunk = self.root.chunks[self.stage_ids.index(s)]
                chunk.eval()
                try:
                    with context():
                        hidden = chunk(hidden)
                finally:
                    chunk.train()
        return hidden if pp_rank == previous else None

    def _pass(self, tensor: torch.Tensor | None, src: int, dst: int) -> torch.Tensor | None:
        """`tensor` from pipeline rank src to dst (its shape and dtype sent first)."""
        pp_rank = self.layout.coord("pp")
        if pp_rank == src:
            assert tensor is not None
            local = local_tensor(tensor).contiguous()
            dist.send_object_list(
                [tuple(local.shape), local.dtype], group_dst=dst, group=self.group
            )
            dist.send(local, group_dst=dst, group=self.group)
            return None
        if pp_rank == dst:
            meta: list = [None, None]
            dist.recv_object_list(meta, group_src=src, group=self.group)
            out = torch.empty(meta[0], dtype=meta[1], device=self.device)
            dist.recv(out, group_src=src, group=self.group)
            return out
        return tensor

    def _broadcast(self, logits: torch.Tensor | None, src: int) -> torch.Tensor:
        pp_rank = self.layout.coord("pp")
        split = isinstance(logits, DTensor)
        meta = (
            [tuple(local_tensor(logits).shape), logits.dtype, split]
            if pp_rank == src
            else [None] * 3
        )
        dist.broadcast_object_list(meta, group_src=src, group=self.group)  # type: ignore[arg-type]
        out = local_tensor(logits).contiguous() if pp_rank == src else None
        if out is None:
            out = torch.empty(meta[0], dtype=meta[1], device=self.device)
        dist.broadcast(out, group_src=src, group=self.group)
        if meta[2] and self.layout.tp > 1:  # vocabulary-split logits on this stage's tp mesh
            return DTensor.from_local(out, self.layout.tp_mesh, [Shard(-1)], run_check=False)
        return out

    # --- tied embeddings -----------------------------------------------------------------------

    def _tied_copies(self, whole: nn.Module) -> list[nn.Parameter]:
        """This rank's copies of the tied table (first and last stage), the first's first; all
        ranks agree whether the model ties one (`_tied_all`)."""
        self.tied_name = tied_table(whole) if self.num_stages > 1 else None
        self._tied_all = self.tied_name is not None
        copies = []
        for chunk in self.root.chunks:
            named = {canonical_name(n): p for n, p in chunk.named_parameters()}
            if self.tied_name in named:
                copies.append(named[self.tied_name])
        return copies

    @torch.no_grad()
    def _sum_tied_grads(self) -> None:
        """The tied table's gradient summed over its copies: locally when one rank holds both
        (zbv), else over the first and last stage's ranks."""
        if not self._tied_all:
            return
        grads = [local_tensor(p.grad) for p in self._tied if p.grad is not None]
        if len(self._tied) == 2 and len(grads) == 2:
            grads[0].add_(grads[1])
            grads[1].copy_(grads[0])
            return
        if self._tied_group is None or not self._tied:
            return
        assert len(grads) == 1, "each copy of the tied table has a gradient after backward"
        dist.all_reduce(grads[0], group=self._tied_group)

    # --- names, shapes and owners --------------------------------------------------------------

    def _owned_params(self) -> dict[str, nn.Parameter]:
        """name -> this rank's parameter, the first stage's copy of a tied table only."""
        owned: dict[str, nn.Parameter] = {}
        for chunk, s in zip(self.root.chunks, self.stage_ids, strict=True):
            for name, p in chunk.named_parameters():
                name = canonical_name(name)
                if name == self.tied_name and s != 0:
                    continue  # the last stage's copy of a tied table (or its own, untied: kept)
                owned.setdefault(name, p)
        return owned

    def local_copy(self, param: torch.Tensor) -> bool:
        """Whether `param` is the second copy of the tied table on a rank that holds the first
        too (zbv): a checkpoint holds one, which load_local_copies copies into it."""
        return len(self._tied) == 2 and param is self._tied[1]

    @torch.no_grad()
    def load_local_copies(self, optimizer: torch.optim.Optimizer) -> None:
        """After a checkpoint load: the second copy of the tied table (local_copy) takes the
        first's values and optimizer state."""
        if len(self._tied) != 2:
            return
        counted, copy = self._tied
        local_tensor(copy).copy_(local_tensor(counted))
        source, target = optimizer.state.get(counted, {}), optimizer.state.get(copy, {})
        for key, value in source.items():
            if isinstance(value, torch.Tensor) and key in target:
                local_tensor(target[key]).copy_(local_tensor(value))
            else:
                target[key] = value

    def named_grads(self) -> list[tuple[str, torch.Tensor]]:
        """Every trainable parameter of the whole model, in its order: this rank's gradient
        shard, or an empty tensor where it holds none (module docstring)."""
        empty = torch.empty(0, device=self.device)
        out = []
        for name in self.whole_names:
            p = self.owned.get(name)
            grad = p.grad if p is not None else None
            out.append((name, local_tensor(grad) if grad is not None else empty))
        return out

    def replication(self) -> list[int]:
        """Per name of named_grads, over how many ranks its gradient is repeated (1 where this
        rank holds none: its statistics are zero)."""
        return [
            self.layout.replication(self.owned[n]) if n in self.owned else 1
            for n in self.whole_names
        ]

    @torch.no_grad()
    def fingerprint(self) -> str:
        """weights_fingerprint of the whole model: each parameter, in name order, gathered
        whole on its stage and sent to pipeline rank 0, which hashes; the digest goes to all."""
        from bigtrain.parallel.backends.base import hash_tensor

        pp_rank = self.layout.coord("pp")
        chunks = len(self.stage_ids)
        h = hashlib.sha256()
        for name in sorted(self.whole_shapes):
            owner = stage_rank(self.schedule_name, self.layout.pp, chunks, self.stage_of[name])
            if pp_rank not in (owner, 0):
                continue
            full = None
            if pp_rank == owner:
                p = self.owned[name]
                full = p.full_tensor() if isinstance(p, DTensor) else p
                full = full.detach().float().contiguous()
            if owner != 0:
                full = self._pass(full, owner, 0)
            if pp_rank == 0:
                assert full is not None
                hash_tensor(h, name, full)
        digest = [h.hexdigest() if pp_rank == 0 else None]
        dist.broadcast_object_list(digest, group_src=0, group=self.group)
        return digest[0]  # type: ignore[return-value]


def _tied_group(layout: Layout, schedule: str, num_stages: int) -> dist.ProcessGroup | None:
    """The ranks of the first and the last stage with this rank's other coordinates (every rank
    makes every such group, as new_group requires); None when one rank runs both stages."""
    chunks = num_stages // layout.pp
    first, last = (
        stage_rank(schedule, layout.pp, chunks, 0),
        stage_rank(schedule, layout.pp, chunks, num_stages - 1),
    )
    if first == last:
        return None
    rest = layout.stage_size
    pairs = [[first * rest + j, last * rest + j] for j in range(rest)]
    if layout.pp == 2:
        return layout.group("pp")
    mine, _ = dist.new_subgroups_by_enumeration(pairs)
    return mine


def tied_table(model: nn.Module) -> str | None:
    """The canonical name of the parameter two modules of `model` share (the token table and
    the output layer), as named_parameters lists it; None without one."""
    shared = shared_params(model)
    if not shared:
        return None
    assert len(shared) == 1, f"one tied table expected, found {len(shared)}"
    module, attr = shared[0][0]
    table = getattr(module, attr)
    return next(canonical_name(n) for n, p in model.named_parameters() if p is table)
