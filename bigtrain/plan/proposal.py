"""`bigtrain plan --propose`: the layouts of a world size for a model and its global batch, why
each loses, and the one proposed.

Every layout is FSDP2 over tp 1, 2, 4 or 8 (inside a node) x cp context-parallel ranks (for long
sequences: a power of two that leaves each rank at least MIN_CP_TOKENS of a sequence; the style,
ring or all_to_all, whose modelled step is shorter) x P pipeline stages (a power of two up to the
blocks) x data-parallel ranks, each data-parallel rank taking its share of the global batch
in one pipeline step of one sequence per micro-batch (interleaved 1F1B with as many chunks per
rank as the blocks allow where the micro-batches are a multiple of P, else 1F1B). Each is the
config re-planned with those keys: its memory is the per-stage table's (stages.rank_loads) and
its step the memory plan's and the goodput plan's (step_time.step_time), so the proposed layout's
numbers are those `bigtrain plan` prints for a config that carries it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from bigtrain.config.parallel import check_context
from bigtrain.errors import ConfigError
from bigtrain.parallel.layout import Layout
from bigtrain.plan.footprint import PlannedRun, replanned, reserve_bytes
from bigtrain.plan.stages import rank_loads, step_bubble
from bigtrain.plan.step_time import assumptions, step_time

MAX_BUBBLE = 0.25
MIN_CP_TOKENS = 8192
"""A context-parallel candidate leaves each rank at least this many tokens of a sequence: below
it attention is a small part of the step and cp's sends are not worth proposing."""


@dataclass(frozen=True)
class Candidate:
    tp: int
    cp: int
    cp_style: str
    pp: int
    dp: int
    chunks: int
    micro_batches: int  # sequences per data-parallel rank and step (one per micro-batch)
    bubble: float
    peak_bytes: float
    step_s: float  # step_time.step_time's total
    parts: dict[str, float]  # the step's seconds by part
    rejected: str  # why not, or "" for a layout that works

    @property
    def schedule(self) -> str:
        return "interleaved_1f1b" if self.chunks > 1 else "1f1b"

    @property
    def name(self) -> str:
        cp = f" x cp {self.cp} {self.cp_style}" if self.cp > 1 else ""
        return f"tp {self.tp}{cp} x pp {self.pp} x dp {self.dp}" + (
            f" (v{self.chunks})" if self.chunks > 1 else ""
        )


def cp_degrees(seq_len: int) -> list[int]:
    """The cp degrees worth a candidate at this sequence length (1, then powers of two)."""
    out, cp = [1], 2
    while seq_len // cp >= MIN_CP_TOKENS and seq_len % (2 * cp) == 0:
        out.append(cp)
        cp *= 2
    return out


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
    """Layouts of `world_size` GPUs for the run's model and global batch (module docstring)."""
    cfg = run.cfg
    seqs = cfg.train.global_batch_size or cfg.train.micro_batch_size * run.layout.dp_size
    out = []
    for tp in (1, 2, 4, 8):
        for cp in cp_degrees(cfg.model.seq_len):
            for pp in (2**k for k in range(8)):
                if pp > cfg.model.n_layers:
                    continue
                sizes = dataclasses.replace(
                    cfg.parallel,
                    backend="fsdp",
                    tensor_parallel=tp,
                    context_parallel=cp,
                    pipeline_parallel=pp,
                    replicate=1,
                )
                try:
                    layout = Layout.of(sizes, world_size)
                except ConfigError:  # tp x cp x pp does not divide the GPUs
                    continue
                dp = layout.dp_size
                per_rank, rest = divmod(seqs, dp)
                if rest or per_rank == 0:
                    why = f"{dp} data-parallel ranks do not divide the global batch of {seqs}"
                    out.append(Candidate(tp, cp, "ring", pp, dp, 1, 0, 1.0, 0.0, 0.0, {}, why))
                    continue
                styles = [_candidate(run, world_size, gpu_memory, tp, cp, s, pp, dp, per_rank)
                          for s in (("ring", "all_to_all") if cp > 1 else ("ring",))]  # fmt: skip
                working = [c for c in styles if c.parts] or styles
                out.append(min(working, key=lambda c: (bool(c.rejected), c.step_s)))
    return out


def candidate_run(
    run: PlannedRun,
    world_size: int,
    tp: int,
    pp: int,
    per_rank: int,
    cp: int = 1,
    cp_style: str = "ring",
) -> PlannedRun:
    """`run`'s config under a candidate's keys (ConfigError: a layout the model cannot take)."""
    cfg = run.cfg
    chunks = _chunks(cfg.model.n_layers, pp, per_rank)
    parallel = dataclasses.replace(
        cfg.parallel,
        backend="fsdp",
        tensor_parallel=tp,
        context_parallel=cp,
        cp_style=cp_style,
        pipeline_parallel=pp,
        pp_schedule="interleaved_1f1b" if chunks > 1 else "1f1b",
        pp_stages_per_rank=chunks,
        pp_microbatches=per_rank if pp > 1 else None,
        pp_split=[],
        replicate=1,
        reshard_after_forward=None,
    )
    train = dataclasses.replace(
        cfg.train, micro_batch_size=per_rank, global_batch_size=None, grad_accum_steps=1
    )
    changed = dataclasses.replace(cfg, parallel=parallel, train=train)
    if cp > 1:
        check_context(parallel, changed.model)  # the heads and chunks the style needs
    return replanned(run, changed, world_size)


def _candidate(
    run: PlannedRun,
    world_size: int,
    gpu_memory: int,
    tp: int,
    cp: int,
    cp_style: str,
    pp: int,
    dp: int,
    per_rank: int,
) -> Candidate:
    chunks = _chunks(run.cfg.model.n_layers, pp, per_rank)
    try:
        trial = candidate_run(run, world_size, tp, pp, per_rank, cp, cp_style)
        peak = max(load.total_bytes for load in rank_loads(trial))
    except ConfigError as e:  # a layout the model cannot take (heads, vocabulary)
        why = str(e).split(":")[0]
        return Candidate(tp, cp, cp_style, pp, dp, chunks, per_rank, 1.0, 0.0, 0.0, {}, why)
    bubble = step_bubble(trial)
    step = step_time(trial)
    why = ""
    if pp > 1 and per_rank < pp:
        why = f"{per_rank} micro-batches per step, fewer than the {pp} stages"
    elif peak > gpu_memory - reserve_bytes(gpu_memory):
        why = "does not fit"
    elif bubble > MAX_BUBBLE:
        why = f"bubble {bubble:.0%} > {MAX_BUBBLE:.0%}"
    parts = {**step.parts, "cp": step.parts.get("cp", 0.0)}  # every candidate's columns alike
    return Candidate(
        tp, cp, cp_style, pp, dp, chunks, per_rank, bubble, peak, step.total, parts, why
    )


def proposal(cands: list[Candidate]) -> Candidate | None:
    """The candidate with the shortest modelled step among those that fit, with a bubble of at
    most MAX_BUBBLE; ties to fewer model-parallel GPUs."""
    ok = [c for c in cands if not c.rejected]
    return min(ok, key=lambda c: (c.step_s, c.tp * c.cp * c.pp)) if ok else None


def proposal_lines(run: PlannedRun, world_size: int, gpu_memory: int, fmt) -> list[str]:
    """The proposed layout at `world_size` GPUs, with every candidate and why it lost."""
    cands = candidates(run, world_size, gpu_memory)
    best = proposal(cands)
    names = ", ".join(next((c.parts for c in cands if c.parts), {"compute": 0.0}))
    lines = [
        "",
        f"layouts of {world_size} GPUs with {fmt(gpu_memory)} each, fsdp, one sequence per "
        f"pipeline micro-batch; step modelled at {assumptions()}:",
        f"  {'layout':<40} {'seq/rank':>8} {'bubble':>7} {'peak/GPU':>10} {'step s':>7}  "
        f"({names.replace('compute', 'compute+bubble')})  why not",
    ]
    for c in cands:
        mark = "  <- proposed" if c is best else ""
        name = c.name
        peak = fmt(c.peak_bytes) if c.peak_bytes else "-"
        parts = ", ".join(f"{v:.2f}" for v in c.parts.values()) if c.parts else "-"
        step = f"{c.step_s:.2f}" if c.parts else "-"
        lines.append(
            f"  {name:<40} {c.micro_batches:>8} {c.bubble:>7.1%} {peak:>10} {step:>7}  "
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
    if best.cp > 1:
        keys += [f"parallel.context_parallel={best.cp}", f"parallel.cp_style={best.cp_style}"]
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
            f"{fastest_flat.step_s:.2f} s, its data-parallel collectives over "
            f"{fastest_flat.dp} ranks {fastest_flat.parts['dp']:.2f} s"
        )
    lines.append(f"  proposed: {' '.join(keys)} ({why})")
    return lines + _cp_against_tp(cands, run.cfg.model.seq_len)


def _cp_against_tp(cands: list[Candidate], seq_len: int) -> list[str]:
    """Where cp was a candidate: its best layout against the best without it, at this length."""
    ok = [c for c in cands if not c.rejected]
    with_cp = min((c for c in ok if c.cp > 1), key=lambda c: c.step_s, default=None)
    without = min((c for c in ok if c.cp == 1), key=lambda c: c.step_s, default=None)
    if len(cp_degrees(seq_len)) == 1:
        return [f"  cp not considered: {seq_len}-token sequences (cp from {2 * MIN_CP_TOKENS})"]
    if with_cp is None:
        return [f"  at {seq_len} tokens no layout with cp fits or keeps its bubble"]
    if without is None:
        return [f"  at {seq_len} tokens only layouts with cp fit: tp alone cannot hold them"]
    faster = with_cp.step_s < without.step_s
    return [
        f"  at {seq_len} tokens {'cp beats tp' if faster else 'tp beats cp'}: "
        f"{with_cp.name} {with_cp.step_s:.2f} s against {without.name} {without.step_s:.2f} s"
    ]
