"""Communication volume of one optimizer step on the fsdp backend's mesh, per rank and mesh axis,
and what tensor parallelism splits (for the states per rank).

Ring collectives over a group of g ranks, for a tensor of E elements of b bytes each: an
all-gather or a reduce-scatter moves (g - 1) / g x E x b bytes into (and out of) every rank; an
all-reduce twice that (a reduce-scatter plus an all-gather). FSDP2 all-gathers every block's
weights in each micro-batch's forward and, when it reshards after forward, again in backward;
gradients are reduce-scattered over the shard axis once per step (gradient sync on the last
micro-batch only) and, under HSDP, the shard's gradients are all-reduced over the replicate axis.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from bigtrain.config.parallel import reshards_after_forward
from bigtrain.config.schema import ParallelConfig
from bigtrain.model.hf_plans import family_plans
from bigtrain.parallel.layout import Layout
from bigtrain.parallel.tensor.plans import GPT_PLAN, block_plan, uses_gpt_plan
from bigtrain.parallel.transforms import transformer_blocks


def ring_bytes(elements: float, group: int, itemsize: int, all_reduce: bool = False) -> float:
    """Bytes each rank receives in a ring all-gather/reduce-scatter (or all-reduce)."""
    if group <= 1:
        return 0.0
    return (2.0 if all_reduce else 1.0) * (group - 1) / group * elements * itemsize


@dataclass(frozen=True)
class AxisTraffic:
    """One mesh axis's traffic per optimizer step and rank."""

    axis: str
    size: int
    collective: str
    bytes_per_step: float


@dataclass(frozen=True)
class TPSplit:
    """What tensor parallelism splits: the parameters of the split layers (all blocks; for
    bigtrain's GPT also the vocabulary-parallel embedding and lm_head), per block the number of
    colwise and rowwise layers, and whether the residual stream is split along the sequence."""

    split_params: int = 0
    colwise: int = 0
    rowwise: int = 0
    num_blocks: int = 0
    sequence_parallel: bool = False

    def per_rank_params(self, num_params: int, tp: int) -> float:
        """Parameters a tp rank holds before FSDP2 shards them: its slice of the split layers."""
        return num_params - self.split_params + self.split_params / tp


SPLIT_STYLES = ("colwise", "rowwise", "colwise_gather_output", "rowwise_split_input")
"""The styles whose weights tensor parallelism splits (colwise_qkv, a per-head norm's and MLA's
down-projection stay whole on every tp rank)."""


def tp_split(model: nn.Module, patterns: dict[str, str]) -> TPSplit:
    """Count what tensor parallelism splits in a (meta-device) model: bigtrain's GPT by its own
    plan, another model by `patterns` (parallel.tp_plan) or, without them, the plan its family
    declares (model/hf_plans.py), block by block (a family's dense and MoE layers differ)."""
    gpt = uses_gpt_plan(model)
    if not gpt and not patterns:
        patterns = family_plans(model.hf).tp  # type: ignore[union-attr]
    blocks = transformer_blocks(model)
    plans = [block_plan(b, GPT_PLAN if gpt else patterns) for b in blocks]
    split = sum(
        p.numel()
        for b, plan in zip(blocks, plans, strict=True)
        for name, style in plan.items()
        if style in SPLIT_STYLES
        for p in b.get_submodule(name).parameters()
    )
    if gpt:  # the vocabulary rows of the embedding and of an untied lm_head
        split += sum(p.numel() for p in {*model.tok_emb.parameters(), *model.lm_head.parameters()})
    # all-reduces per block (the first's plan): a colwise layer's input gradient, a rowwise
    # layer's output (gathered outputs and fused q/k/v counted as colwise)
    styles = [s.split("_")[0] for s in plans[0].values() if s in (*SPLIT_STYLES, "colwise_qkv")]
    return TPSplit(split, styles.count("colwise"), styles.count("rowwise"), len(blocks), gpt)


def tp_traffic(tp: TPSplit, size: int, accum: int, activation_bytes: float) -> AxisTraffic:
    """The tp axis per step. Without sequence parallelism each colwise layer all-reduces its
    input gradient (backward) and each rowwise layer its output (forward). With it (bigtrain's
    GPT) each block all-gathers its attention and MLP inputs and reduce-scatters their outputs,
    and backward does the reverse; lm_head's input is gathered once more (the embedding's
    reduce-scatter, or all-reduce with learned positions, and the loss's per-token scalars are
    left out)."""
    if not tp.sequence_parallel:
        count = accum * tp.num_blocks * (tp.colwise + tp.rowwise)
        moved = count * ring_bytes(activation_bytes, size, 1, all_reduce=True)
        return AxisTraffic("tp", size, f"all-reduce x {count}", moved)
    count = accum * (4 * tp.num_blocks + 1)  # all-gathers, and as many reduce-scatters
    moved = 2 * count * ring_bytes(activation_bytes, size, 1)
    return AxisTraffic("tp", size, f"all-gather + reduce-scatter x {count}", moved)


def fsdp_traffic(
    parallel: ParallelConfig,
    grad_accum_steps: int,
    layout: Layout,
    num_params: int,
    gathered_itemsize: int,
    reduce_itemsize: int,
    tp: TPSplit | None = None,
    activation_bytes: float = 0.0,
) -> list[AxisTraffic]:
    """Per mesh axis (tp, shard, replicate) of `layout`, what one step moves through each rank.
    `activation_bytes`: one micro-batch's residual stream (micro x seq x d_model, compute dtype),
    what tensor parallelism moves around each split layer (tp_traffic); activation recompute
    adds forward ones, not counted here."""
    tp = tp or TPSplit()
    held = tp.per_rank_params(num_params, layout.tp)  # what FSDP2 shards on this tp rank
    accum = grad_accum_steps
    ranks = layout.shard_ranks  # shard x cp
    gathers = accum * (2 if reshards_after_forward(parallel) else 1)
    out = []
    if layout.tp > 1:
        out.append(tp_traffic(tp, layout.tp, accum, activation_bytes))
    out += [
        AxisTraffic(
            "shard",
            ranks,
            f"all-gather x {gathers}",
            gathers * ring_bytes(held, ranks, gathered_itemsize),
        ),
        AxisTraffic(
            "shard",
            ranks,
            "reduce-scatter x 1",
            ring_bytes(held, ranks, reduce_itemsize),
        ),
    ]
    if layout.replicate > 1:
        shard_elements = held / ranks
        out.append(
            AxisTraffic(
                "replicate",
                layout.replicate,
                "all-reduce x 1",
                ring_bytes(shard_elements, layout.replicate, reduce_itemsize, all_reduce=True),
            )
        )
    return out


def cp_traffic(
    style: str,
    cp: int,
    layers: int,
    passes: tuple[int, int],
    tokens: float,
    widths: tuple[int, int],
    itemsize: int,
) -> AxisTraffic:
    """What context parallelism moves out of a rank per step (and as much in): `passes`, the
    (forward, backward) passes of every attention layer per step (micro-batches; forwards again
    where activation checkpointing recomputes them), over `tokens` of this rank per
    micro-batch; widths: (query heads x head_dim, key/value heads x head_dim) of the rank (per
    tp rank). ring: a forward passes its keys and values on cp - 1 times; a backward passes
    them cp - 1 times again and their FP32 gradients cp times. all_to_all: q, k, v and the
    output all-to-all'd once per pass, (cp - 1) / cp of each leaving the rank (the key/value
    width after heads are repeated to a multiple of cp)."""
    (forwards, backwards), (q_width, kv_width) = passes, widths
    if style == "ring":
        forward = (cp - 1) * 2 * kv_width * itemsize
        backward = forward + cp * 2 * kv_width * 4
        moved = layers * tokens * (forwards * forward + backwards * backward)
        sends = layers * (forwards * (cp - 1) + backwards * (2 * cp - 1))
        return AxisTraffic("cp", cp, f"ring send/recv x {sends}", moved)
    per_pass = (cp - 1) / cp * (2 * q_width + 2 * kv_width) * itemsize
    moved = layers * tokens * (forwards + backwards) * per_pass
    return AxisTraffic("cp", cp, f"all-to-all x {layers * (forwards + backwards) * 4}", moved)


def zero_traffic(
    stage: int,
    grad_accum_steps: int,
    dp: int,
    num_params: int,
    compute_itemsize: int,
    reduce_itemsize: int,
) -> list[AxisTraffic]:
    """DeepSpeed ZeRO's volumes per rank and step (the ZeRO paper, section 7): stages 1 and 2
    reduce-scatter the gradients and all-gather the updated compute copies (a data-parallel
    all-reduce's volume); stage 3 gathers the compute copies in every micro-batch's forward and
    backward, then reduce-scatters the gradients (1.5 times that with one micro-batch)."""
    gathers = 2 * grad_accum_steps if stage == 3 else 1
    return [
        AxisTraffic(
            "shard",
            dp,
            f"all-gather x {gathers}",
            gathers * ring_bytes(num_params, dp, compute_itemsize),
        ),
        AxisTraffic("shard", dp, "reduce-scatter x 1", ring_bytes(num_params, dp, reduce_itemsize)),
    ]
