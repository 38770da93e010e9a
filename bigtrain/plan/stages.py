"""The pipeline dimension in `bigtrain plan`: what each pipeline rank holds and moves, the bubble
of its schedule, and a proposed layout for a big run.

Per pipeline rank (its chunks' blocks, from the same split a run makes: parallel/pipeline_split.py):
- states: its parameters x the backend's bytes per parameter, sharded over the stage's ranks;
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
from dataclasses import dataclass

from bigtrain.config.parallel import pp_microbatches, pp_stages_per_rank
from bigtrain.errors import ConfigError
from bigtrain.model.gpt import num_params
from bigtrain.parallel.layout import Layout
from bigtrain.parallel.pipeline import rank_stages
from bigtrain.parallel.pipeline_split import block_modules, end_params, stage_bounds
from bigtrain.plan.footprint import (
    PlannedRun,
    activation_bytes_per_token,
    residual_bytes,
    transient_weight_bytes,
)


@dataclass(frozen=True)
class RankLoad:
    """One pipeline rank: its blocks, parameters and bytes per GPU."""

    pp_rank: int
    blocks: list[tuple[int, int]]  # [start, end) per chunk
    params: int
    in_flight: float  # micro-batches through all its layers at the peak
    states_bytes: float
    transient_bytes: float
    activation_bytes: float

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


def in_flight(schedule: str, pp: int, chunks: int, m: int, pp_rank: int) -> float:
    """Micro-batches whose activations rank pp_rank holds at its peak, in units of one
    micro-batch through all of its layers."""
    if schedule == "gpipe":
        return float(m)
    if schedule == "interleaved_1f1b":
        warmup = 2 * (pp - pp_rank - 1) + (chunks - 1) * pp + 1
        return min(warmup, m * chunks) / chunks
    return float(min(m, pp - pp_rank))


def rank_loads(run: PlannedRun) -> list[RankLoad]:
    """Every pipeline rank's load (one entry without pipeline stages)."""
    cfg, layout, model, policy = run.cfg, run.layout, run.model, run.policy
    p = cfg.parallel
    chunks = pp_stages_per_rank(p) if layout.pp > 1 else 1
    stages = layout.pp * chunks
    bounds = stage_bounds(model, stages, p.pp_split, cfg.model.seq_len)
    block_params = [num_params(b) for b in block_modules(model)]
    first_params, last_params = end_params(model)
    split = run.tp_split_ways
    m = pp_microbatches(p, cfg.train.micro_batch_size) if layout.pp > 1 else 1
    per_micro = cfg.train.micro_batch_size / m  # sequences per pipeline micro-batch
    c = policy.compute_dtype.itemsize
    a = activation_bytes_per_token(
        run.shape,
        p.activation_checkpointing,
        c,
        residual_bytes(run.backend, policy),
        policy.fp32_softmax,
    )
    per_layer = a["layers"] / run.shape.n_layers * run.shape.seq_len / split
    per_bytes = sum(run.states().per_rank_bytes_per_param(run.degree).values())
    out = []
    for r in range(layout.pp):
        ids = rank_stages(p.pp_schedule, layout.pp, chunks, r) if layout.pp > 1 else [0]
        spans = [(bounds[s], bounds[s + 1]) for s in ids]
        layers = sum(b - a_ for a_, b in spans)
        params = sum(sum(block_params[a_:b]) for a_, b in spans)
        if 0 in ids:
            params += first_params
        if stages - 1 in ids:
            params += last_params
        flight = in_flight(p.pp_schedule, layout.pp, chunks, m, r) if layout.pp > 1 else 1.0
        activations = flight * per_micro * per_layer * layers
        if stages - 1 in ids:  # the loss's logits and the head, one micro-batch at a time
            activations += per_micro * (a["head"] + a["transient"]) * run.shape.seq_len / split
        largest = max(block_params[a_:b] and max(block_params[a_:b]) for a_, b in spans)
        transient = transient_weight_bytes(p, policy, params, largest) / split
        out.append(RankLoad(r, spans, params, flight, per_bytes * params, transient, activations))
    return out


def p2p_bytes(run: PlannedRun) -> float:
    """Bytes a middle pipeline rank sends per optimizer step (and receives as many): each
    micro-batch's hidden states forward and their gradients backward, per chunk."""
    cfg, layout = run.cfg, run.layout
    if layout.pp == 1:
        return 0.0
    chunks = pp_stages_per_rank(cfg.parallel)
    values = cfg.train.micro_batch_size * run.shape.seq_len * run.shape.d_model / run.tp_split_ways
    return 2 * chunks * cfg.train.grad_accum_steps * values * run.policy.compute_dtype.itemsize


def pipeline_lines(run: PlannedRun, fmt) -> list[str]:
    """`bigtrain plan`'s pipeline section (nothing without stages)."""
    layout, p = run.layout, run.cfg.parallel
    if layout.pp == 1:
        return []
    chunks = pp_stages_per_rank(p)
    m = pp_microbatches(p, run.cfg.train.micro_batch_size)
    bubble = bubble_fraction(p.pp_schedule, layout.pp, chunks, m)
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


# What the layout proposal assumes of a GPU cluster (H100-class, as in docs/parallelism.md): BF16
# dense peak and the share of it a step reaches, NVLink inside a node (tp), InfiniBand per GPU
# between nodes (FSDP2's collectives, point to point between stages).
PEAK_FLOPS = 989e12
EFFICIENCY = 0.4
NVLINK_BYTES_S = 450e9
NETWORK_BYTES_S = 50e9
MAX_BUBBLE = 0.25


@dataclass(frozen=True)
class Candidate:
    tp: int
    pp: int
    dp: int
    chunks: int
    micro_batches: int  # sequences per data-parallel rank and step (one per micro-batch)
    bubble: float
    peak_bytes: float
    step_s: float  # modelled: compute / (1 - bubble) + collectives + point to point
    parts: dict[str, float]  # the step's seconds by part
    rejected: str  # why not, or "" for a layout that works

    @property
    def schedule(self) -> str:
        return "interleaved_1f1b" if self.chunks > 1 else "1f1b"


def _chunks(n_layers: int, pp: int, micro_batches: int) -> int:
    """Chunks per rank of a candidate: the most (a power of two) whose stages all have a block,
    where interleaved 1F1B can run (micro-batches a multiple of pp); 1 without stages."""
    if pp == 1 or micro_batches % pp:
        return 1
    v = 1
    while 2 * v * pp <= n_layers:
        v *= 2
    return v


def candidates(run: PlannedRun, world_size: int, gpu_memory: int) -> list[Candidate]:
    """Layouts of `world_size` GPUs for the run's model and global batch (module docstring of
    proposal)."""
    cfg = run.cfg
    seqs = cfg.train.global_batch_size or cfg.train.micro_batch_size * run.layout.dp_size
    out = []
    for tp in (1, 2, 4, 8):
        for pp in (2**k for k in range(8)):
            if pp > cfg.model.n_layers:
                continue
            sizes = dataclasses.replace(
                cfg.parallel, backend="fsdp", tensor_parallel=tp, pipeline_parallel=pp, replicate=1
            )
            try:
                layout = Layout.of(sizes, world_size)
            except ConfigError:  # tp x pp does not divide the GPUs
                continue
            dp = layout.dp_size
            per_rank, rest = divmod(seqs, dp)
            if rest or per_rank == 0:
                why = f"{dp} data-parallel ranks do not divide the global batch of {seqs}"
                out.append(Candidate(tp, pp, dp, 1, 0, 1.0, 0.0, 0.0, {}, why))
                continue
            out.append(_candidate(run, world_size, gpu_memory, tp, pp, dp, per_rank))
    return out


def _candidate(
    run: PlannedRun, world_size: int, gpu_memory: int, tp: int, pp: int, dp: int, per_rank: int
) -> Candidate:
    from bigtrain.plan.comm import fsdp_traffic
    from bigtrain.plan.footprint import gathered_dtype_bytes, replanned, reserve_bytes

    cfg = run.cfg
    chunks = _chunks(cfg.model.n_layers, pp, per_rank)
    schedule = "interleaved_1f1b" if chunks > 1 else "1f1b"
    parallel = dataclasses.replace(
        cfg.parallel,
        backend="fsdp",
        tensor_parallel=tp,
        pipeline_parallel=pp,
        pp_schedule=schedule,
        pp_stages_per_rank=chunks,
        pp_microbatches=per_rank if pp > 1 else None,
        pp_split=[],
        replicate=1,
        reshard_after_forward=None,
    )
    train = dataclasses.replace(
        cfg.train, micro_batch_size=per_rank, global_batch_size=None, grad_accum_steps=1
    )
    try:
        trial = replanned(run, dataclasses.replace(cfg, parallel=parallel, train=train), world_size)
        loads = rank_loads(trial)
    except ConfigError as e:  # a layout the model cannot take (heads, vocabulary)
        return Candidate(tp, pp, dp, chunks, per_rank, 1.0, 0.0, 0.0, {}, str(e).split(":")[0])
    peak = max(load.total_bytes for load in loads)
    bubble = bubble_fraction(schedule, pp, chunks, per_rank)
    # One model copy (tp x pp GPUs) trains its data-parallel rank's tokens.
    tokens = per_rank * cfg.model.seq_len
    compute = 6.0 * run.num_params * tokens / (trial.layout.model_size * PEAK_FLOPS * EFFICIENCY)
    policy = trial.policy
    activations = per_rank * cfg.model.seq_len * run.shape.d_model * policy.compute_dtype.itemsize
    traffic = fsdp_traffic(
        parallel,
        1,
        trial.layout,
        run.num_params,
        gathered_dtype_bytes(policy),
        policy.reduce_dtype.itemsize,
        trial.tp,
        activations,
    )
    # The whole model's traffic, of which a pipeline rank moves its stage's share: its
    # parameters' for FSDP2, its blocks' (1 / pp) for tp.
    stage_share = max(load.params for load in loads) / run.num_params
    network = sum(t.bytes_per_step for t in traffic if t.axis != "tp")
    parts = {
        "compute": compute / (1 - bubble) if bubble < 1 else float("inf"),
        "tp": sum(t.bytes_per_step for t in traffic if t.axis == "tp") / NVLINK_BYTES_S / pp,
        "fsdp": stage_share * network / NETWORK_BYTES_S,
        "p2p": p2p_bytes(trial) / NETWORK_BYTES_S,
    }
    why = ""
    if pp > 1 and per_rank < pp:
        why = f"{per_rank} micro-batches per step, fewer than the {pp} stages"
    elif peak > gpu_memory - reserve_bytes(gpu_memory):
        why = "does not fit"
    elif bubble > MAX_BUBBLE:
        why = f"bubble {bubble:.0%} > {MAX_BUBBLE:.0%}"
    return Candidate(tp, pp, dp, chunks, per_rank, bubble, peak, sum(parts.values()), parts, why)


def proposal(cands: list[Candidate]) -> Candidate | None:
    """The candidate with the shortest modelled step among those that fit, with a bubble of at
    most MAX_BUBBLE; ties to fewer model-parallel GPUs."""
    ok = [c for c in cands if not c.rejected]
    return min(ok, key=lambda c: (c.step_s, c.tp * c.pp)) if ok else None


def proposal_lines(run: PlannedRun, world_size: int, gpu_memory: int, fmt) -> list[str]:
    """The proposed layout at `world_size` GPUs, with every candidate and why it lost."""
    cands = candidates(run, world_size, gpu_memory)
    best = proposal(cands)
    lines = [
        "",
        f"layouts of {world_size} GPUs with {fmt(gpu_memory)} each, fsdp, one sequence per "
        f"pipeline micro-batch; step modelled at {PEAK_FLOPS / 1e12:.0f} TFLOP/s x "
        f"{EFFICIENCY:.0%}, tp over {NVLINK_BYTES_S / 1e9:.0f} GB/s, FSDP2 and stages over "
        f"{NETWORK_BYTES_S / 1e9:.0f} GB/s per GPU, no overlap (an upper bound):",
        f"  {'layout':<27} {'seq/rank':>8} {'bubble':>7} {'peak/GPU':>10} {'step s':>7}  "
        "(compute+bubble, tp, fsdp, p2p)  why not",
    ]
    for c in cands:
        mark = "  <- proposed" if c is best else ""
        name = f"tp {c.tp} x pp {c.pp} x dp {c.dp}" + (f" (v{c.chunks})" if c.chunks > 1 else "")
        peak = fmt(c.peak_bytes) if c.peak_bytes else "-"
        parts = ", ".join(f"{v:.2f}" for v in c.parts.values()) if c.parts else "-"
        step = f"{c.step_s:.2f}" if c.parts else "-"
        lines.append(
            f"  {name:<27} {c.micro_batches:>8} {c.bubble:>7.1%} {peak:>10} {step:>7}  "
            f"({parts})  {c.rejected}{mark}"
        )
    if best is None:
        seqs = max((c.micro_batches * c.dp for c in cands), default=0)
        lines.append(
            f"  none works: at {world_size} GPUs a global batch of {seqs or 'these'} sequences "
            "leaves too few per data-parallel rank to fill a pipeline, or the model does not "
            "fit; raise train.global_batch_size or use fewer GPUs"
        )
        return lines
    keys = [f"parallel.tensor_parallel={best.tp}", f"train.micro_batch_size={best.micro_batches}"]
    if best.pp > 1:
        keys += [
            f"parallel.pipeline_parallel={best.pp}",
            f"parallel.pp_schedule={best.schedule}",
            f"parallel.pp_stages_per_rank={best.chunks}",
        ]
    fastest_flat = min(
        (c for c in cands if c.pp == 1 and c.parts), key=lambda c: c.step_s, default=None
    )
    why = f"the shortest modelled step, {best.step_s:.2f} s"
    if best.pp > 1 and fastest_flat is not None:
        why += (
            f"; without stages the best is tp {fastest_flat.tp} x dp {fastest_flat.dp} at "
            f"{fastest_flat.step_s:.2f} s, its FSDP2 collectives over "
            f"{fastest_flat.dp} ranks {fastest_flat.parts['fsdp']:.2f} s"
        )
    lines.append(f"  proposed: {' '.join(keys)} ({why})")
    return lines


def planned_memory(run: PlannedRun) -> dict[str, int]:
    """footprint.predicted_memory, or with pipeline stages the largest pipeline rank's (the
    `oom` event's numbers)."""
    from bigtrain.plan.footprint import predicted_memory

    if run.layout.pp == 1:
        return predicted_memory(run)
    load = max(rank_loads(run), key=lambda r: r.total_bytes)
    sizes = {
        "states": load.states_bytes,
        "transient_weights": load.transient_bytes,
        "activations": load.activation_bytes,
        "total": load.total_bytes,
    }
    return {"world_size": run.layout.world_size, "pp_rank": load.pp_rank} | {
        f"{k}_bytes": int(v) for k, v in sizes.items()
    }
