"""What each GPU of a planned run holds (`rank_loads`: the one account of its memory, which every
section of `bigtrain plan` and the goodput plan's checkpoint bytes read), and the pipeline
dimension: what each pipeline rank holds and moves, and the bubble of its schedule.

Without stages the one rank's states, transient weights and activations of a micro-batch are
footprint.py's accounting of the whole model. Per pipeline rank (its chunks' blocks, from the
same split a run makes: parallel/pipeline/split.py):
- states: its parameters x the backend's bytes per parameter, sharded over the stage's ranks;
- transient weights: its blocks as FSDP2 gathers them (all of them: a stage stays gathered from
  its first forward to its last backward), an MoE block's experts over expert parallelism;
- activations: the micro-batches in flight at its peak, each through its layers (1f1b: pp - r on
  rank r; gpipe: all of them; interleaved_1f1b: Megatron's warm-up count of chunk forwards,
  2 (pp - r - 1) + (V - 1) pp + 1, each through 1/V of its layers; zbv: as 1f1b, its paper's
  peak); the last stage adds the output layer's logits;
- point to point: each micro-batch's hidden states out of every chunk but the last stage and
  their gradients back, (micro-batch x seq / tp x d_model) values each way per chunk.

The bubble: idle share of a step, (pp - 1) / (m + pp - 1) for gpipe and 1f1b with m
micro-batches, (pp - 1) / (V m + pp - 1) interleaved (Narayanan et al. 2021), and zbv's
(pp - 1)(F + B - 2W) / ... taken as 0 once m >= 2 pp (Qi et al. 2024), else as interleaved.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from torch import nn

from bigtrain.config.parallel import pp_microbatches, pp_stages_per_rank
from bigtrain.model.gpt import num_params
from bigtrain.parallel.pipeline.schedule import rank_stages
from bigtrain.parallel.pipeline.split import end_params, stage_bounds
from bigtrain.parallel.transforms import transformer_blocks
from bigtrain.plan.footprint import (
    PlannedRun,
    activation_bytes_per_token,
    largest_micro_batch,
    residual_bytes,
    transient_weight_bytes,
)
from bigtrain.plan.shapes import gathered_block_params


@dataclass(frozen=True)
class RankLoad:
    """One pipeline rank (the whole model's rank without stages): its blocks, parameters and
    bytes per GPU. The one account of a GPU's memory: the memory table, the per-stage table, the
    largest micro-batch, the layout proposal, a run's `oom` event and the goodput plan's
    checkpoint bytes all read it."""

    pp_rank: int
    blocks: list[tuple[int, int]]  # [start, end) per chunk
    params: int
    in_flight: float  # micro-batches through all its layers at the peak
    states: dict[str, float]  # bytes by component (footprint.COMPONENTS)
    transient_bytes: float
    activation_bytes: float
    sequences: float  # sequences per micro-batch the activations are of

    @property
    def states_bytes(self) -> float:
        return sum(self.states.values())

    @property
    def checkpoint_bytes(self) -> float:
        """What a checkpoint saves of this rank: its master weights and optimizer states."""
        return self.states["master weights"] + self.states["optimizer states"]

    @property
    def total_bytes(self) -> float:
        return self.states_bytes + self.transient_bytes + self.activation_bytes


def bubble_fraction(schedule: str, pp: int, chunks: int, m: int) -> float:
    """The idle share of a step under the schedule (module docstring)."""
    if pp == 1:
        return 0.0
    if schedule == "zbv" and m >= 2 * pp:
        return 0.0
    v = chunks if schedule in ("interleaved_1f1b", "zbv") else 1
    return (pp - 1) / (v * m + pp - 1)


def step_bubble(run: PlannedRun) -> float:
    """The bubble of the run's own schedule (0 without stages)."""
    p = run.cfg.parallel
    if run.layout.pp == 1:
        return 0.0
    m = pp_microbatches(p, run.cfg.train.micro_batch_size)
    return bubble_fraction(p.pp_schedule, run.layout.pp, pp_stages_per_rank(p), m)


def in_flight(schedule: str, pp: int, chunks: int, m: int, pp_rank: int) -> float:
    """Micro-batches whose activations rank pp_rank holds at its peak, in units of one
    micro-batch through all of its layers."""
    if schedule == "gpipe":
        return float(m)
    if schedule == "interleaved_1f1b":
        warmup = 2 * (pp - pp_rank - 1) + (chunks - 1) * pp + 1
        return min(warmup, m * chunks) / chunks
    return float(min(m, pp - pp_rank))


@functools.lru_cache(maxsize=64)
def _bounds(model: nn.Module, stages: int, split: tuple[int, ...], seq_len: int) -> list[int]:
    """stage_bounds, once per model and split: its balancing is a dynamic programme over blocks
    x stages (a second on a 126-block model), and every section of a plan asks for it."""
    return stage_bounds(model, stages, list(split), seq_len)


@functools.lru_cache(maxsize=16)
def _block_params(model: nn.Module, ep: int) -> tuple[list[int], list[float]]:
    """Each block's parameters, and as one rank gathers it (shapes.gathered_block_params), once
    per model: every section of a plan asks for them."""
    return [num_params(b) for b in transformer_blocks(model)], gathered_block_params(model, ep)


@functools.lru_cache(maxsize=16)
def _end_params(model: nn.Module) -> tuple[int, int]:
    """pipeline_split.end_params, once per model."""
    return end_params(model)


def rank_loads(run: PlannedRun) -> list[RankLoad]:
    """Every pipeline rank's load (one entry without pipeline stages)."""
    cfg, layout, model, policy = run.cfg, run.layout, run.model, run.policy
    p = cfg.parallel
    split = run.activation_split
    per_param = run.states().per_rank_bytes_per_param(run.degree)
    a = activation_bytes_per_token(
        run.shape,
        p.activation_checkpointing,
        policy.compute_dtype.itemsize,
        residual_bytes(run.backend, policy),
        policy.fp32_softmax,
    )
    seq = run.shape.seq_len
    per_layer = a["layers"] / run.shape.n_layers * seq / split  # one sequence through one layer
    head = (a["head"] + a["transient"]) * seq / split  # the loss's logits and the head
    block_params, gathered = _block_params(model, layout.ep)
    if layout.pp == 1:
        n, mb = run.num_params, cfg.train.micro_batch_size
        ends = n - sum(block_params)
        held = sum(gathered) + ends  # what FSDP2 gathers when it keeps every block
        transient = transient_weight_bytes(p, policy, held, run.block_params) / split
        states = {c: b * n for c, b in per_param.items()}
        layers = run.shape.n_layers
        activations = mb * (per_layer * layers + head)
        return [RankLoad(0, [(0, layers)], n, 1.0, states, transient, activations, mb)]
    chunks = pp_stages_per_rank(p)
    stages = layout.pp * chunks
    bounds = _bounds(model, stages, tuple(p.pp_split), cfg.model.seq_len)
    first_params, last_params = _end_params(model)
    m = pp_microbatches(p, cfg.train.micro_batch_size)
    per_micro = cfg.train.micro_batch_size / m  # sequences per pipeline micro-batch
    out = []
    for r in range(layout.pp):
        ids = rank_stages(p.pp_schedule, layout.pp, chunks, r)
        spans = [(bounds[s], bounds[s + 1]) for s in ids]
        ends = (first_params if 0 in ids else 0) + (last_params if stages - 1 in ids else 0)
        params = sum(sum(block_params[s:e]) for s, e in spans) + ends
        held = sum(sum(gathered[s:e]) for s, e in spans) + ends
        largest = max(max(gathered[s:e], default=0) for s, e in spans)
        layers = sum(e - s for s, e in spans)
        flight = in_flight(p.pp_schedule, layout.pp, chunks, m, r)
        activations = flight * per_micro * per_layer * layers
        if stages - 1 in ids:  # the loss's logits and the head, one micro-batch at a time
            activations += per_micro * head
        transient = transient_weight_bytes(p, policy, held, largest) / split
        states = {c: b * params for c, b in per_param.items()}
        out.append(RankLoad(r, spans, params, flight, states, transient, activations, per_micro))
    return out


def most_states(run: PlannedRun) -> RankLoad:
    """The rank holding the most states: the state bytes per GPU of the memory table, and what
    one GPU's checkpoint holds (checkpoint_bytes_per_gpu)."""
    return max(rank_loads(run), key=lambda load: load.states_bytes)


def checkpoint_bytes_per_gpu(run: PlannedRun) -> float:
    """Master weights and optimizer states on the GPU that holds the most: the goodput plan's
    checkpoint bytes per GPU (its save, load, snapshot and peer transfer)."""
    return most_states(run).checkpoint_bytes


def with_checkpointing(run: PlannedRun, mode: str) -> PlannedRun:
    """`run` under another parallel.activation_checkpointing."""
    parallel = dataclasses.replace(run.cfg.parallel, activation_checkpointing=mode)
    return dataclasses.replace(run, cfg=dataclasses.replace(run.cfg, parallel=parallel))


def micro_batch_fit(run: PlannedRun, gpu_memory: int) -> tuple[int, RankLoad]:
    """The most sequences per micro-batch (per pipeline micro-batch with stages, their number and
    the schedule held) that fit on every rank beside its states and transient weights, and the
    rank that sets it."""
    fits = [
        (largest_micro_batch(gpu_memory, r.states_bytes, r.transient_bytes, per_sequence), r)
        for r in rank_loads(run)
        if (per_sequence := r.activation_bytes / r.sequences) > 0
    ]
    return min(fits, key=lambda fit: fit[0])


def p2p_bytes(run: PlannedRun) -> float:
    """Bytes a middle pipeline rank sends per optimizer step (and receives as many): each
    micro-batch's hidden states forward and their gradients backward, per chunk."""
    cfg, layout = run.cfg, run.layout
    if layout.pp == 1:
        return 0.0
    chunks = pp_stages_per_rank(cfg.parallel)
    values = (
        cfg.train.micro_batch_size * run.shape.seq_len * run.shape.d_model / run.activation_split
    )
    return 2 * chunks * cfg.train.grad_accum_steps * values * run.policy.compute_dtype.itemsize


def pipeline_lines(run: PlannedRun, fmt) -> list[str]:
    """`bigtrain plan`'s pipeline section (nothing without stages)."""
    layout, p = run.layout, run.cfg.parallel
    if layout.pp == 1:
        return []
    chunks = pp_stages_per_rank(p)
    m = pp_microbatches(p, run.cfg.train.micro_batch_size)
    bubble = step_bubble(run)
    lines = [
        "",
        f"pipeline: {layout.pp} ranks x {chunks} chunk(s), schedule {p.pp_schedule}, {m} "
        f"micro-batches per step: bubble {bubble:.1%}; point to point "
        f"{fmt(p2p_bytes(run))} each way per rank and optimizer step",
        f"  {'rank':>4} {'blocks':<18} {'params':>9} {'in flight':>9} {'states':>10} "
        f"{'transient':>10} {'activations':>11} {'total':>10}",
    ]
    for load in rank_loads(run):
        layers = sum(b - a for a, b in load.blocks)
        spans = (
            f"{load.blocks[0][0]}-{load.blocks[0][1] - 1}"
            if len(load.blocks) == 1
            else f"{layers} in {len(load.blocks)} chunks"
        )
        lines.append(
            f"  {load.pp_rank:>4} {spans:<18} {load.params / 1e9:>8.2f}B {load.in_flight:>9.1f} "
            f"{fmt(load.states_bytes):>10} {fmt(load.transient_bytes):>10} "
            f"{fmt(load.activation_bytes):>11} {fmt(load.total_bytes):>10}"
        )
    return lines


def planned_memory(run: PlannedRun) -> dict[str, int]:
    """The memory of the rank with the largest total, as numbers (a run's `oom` event); with
    pipeline stages its `pp_rank`."""
    load = max(rank_loads(run), key=lambda r: r.total_bytes)
    sizes = {
        "states": load.states_bytes,
        "transient_weights": load.transient_bytes,
        "activations": load.activation_bytes,
        "total": load.total_bytes,
    }
    where = {"pp_rank": load.pp_rank} if run.layout.pp > 1 else {}
    return (
        {"world_size": run.layout.world_size}
        | where
        | {f"{k}_bytes": int(v) for k, v in sizes.items()}
    )
