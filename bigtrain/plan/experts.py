"""The planner's mixture-of-experts section (model.moe; docs/moe.md): total against active
parameters, where the experts live per rank, and the all-to-all traffic of expert parallelism.

Active parameters are those one token's forward multiplies: everything but the routed experts,
plus top_k of them per MoE block; the FLOPs per token (MFU) count these. Under expert parallelism
each rank holds experts / ep of every MoE block's experts, FSDP2-sharded over the remaining
shard / ep ranks: the states per rank are those of plain FSDP2 (every parameter over the shard
ranks), but a gathered MoE block holds only its rank's experts. Each MoE layer sends every
token-expert pair whose expert lives elsewhere to that rank and back (dispatch and combine), in
forward and again in backward: with balanced routing a share (ep - 1) / ep of a rank's
tokens x top_k rows of d_model values, in the compute dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from bigtrain.config.schema import ModelConfig
from bigtrain.model.routed import routed_experts
from bigtrain.parallel.layout import Layout
from bigtrain.parallel.transforms import transformer_blocks
from bigtrain.plan.comm import AxisTraffic, ring_bytes


@dataclass(frozen=True)
class ExpertCount:
    total: int  # every parameter
    experts: int  # the routed experts' (all MoE layers)
    active: int  # per token: total - experts + top_k / experts of them
    layers: int  # MoE layers
    per_layer: int  # one MoE layer's routed experts
    routed: int  # experts of an MoE layer
    top_k: int  # of them, those one token goes through
    blocks: int  # transformer blocks, MoE or dense


def count_experts(model: nn.Module) -> ExpertCount | None:
    """The parameter counts of a (meta-device) MoE model, bigtrain's GPT or a transformers MoE
    family (its declared experts: model/routed.py); None for a dense model."""
    routed = routed_experts(model)
    if not routed:
        return None
    experts = sum(r.params for r in routed)
    total = sum(p.numel() for p in model.parameters())
    active = total - sum(r.params - r.active for r in routed)
    first, blocks = routed[0], len(transformer_blocks(model))
    return ExpertCount(
        total,
        experts,
        active,
        len(routed),
        experts // len(routed),
        first.experts,
        first.top_k,
        blocks,
    )


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def all_to_all_bytes(
    count: ExpertCount | None,
    tokens_per_micro_batch: int,
    accum: int,
    ep: int,
    itemsize: int,
    d_model: int,
) -> float:
    """Bytes a rank sends (and receives) per optimizer step in the MoE layers' all-to-alls:
    per layer and micro-batch, dispatch and combine in forward and in backward, of the pairs
    whose expert is on another of the ep ranks (balanced routing)."""
    if ep <= 1 or count is None:
        return 0.0
    pairs = tokens_per_micro_batch * count.top_k * (ep - 1) / ep
    per_layer = 4 * pairs * d_model * itemsize  # (dispatch + combine) x (forward + backward)
    return per_layer * count.layers * accum


def expert_traffic(
    count: ExpertCount | None, layout: Layout, gathers: int, gathered: int, reduced: int
) -> tuple[int, list[AxisTraffic]]:
    """Under expert parallelism: the parameters the shard axis's FSDP2 traffic is of (the rest
    of the model), and the experts' own FSDP2 traffic over edp (each rank's experts / ep)."""
    if count is None or layout.ep == 1:
        return (count.total if count else 0), []
    held, edp = count.experts / layout.ep, layout.shard_ranks // layout.ep
    return count.total - count.experts, [
        AxisTraffic(
            "edp", edp, f"all-gather x {gathers}", gathers * ring_bytes(held, edp, gathered)
        ),
        AxisTraffic("edp", edp, "reduce-scatter x 1", ring_bytes(held, edp, reduced)),
    ]


def expert_lines(
    count: ExpertCount | None,
    m: ModelConfig,
    tokens: int,
    accum: int,
    ep: int,
    shard: int,
    itemsize: int,
    d_model: int,
    fmt_bytes,
) -> list[str]:
    """The plan's MoE section; nothing for a dense model."""
    if count is None:
        return []
    share = count.active / count.total
    e = m.moe if m.kind == "gpt" else None  # a transformers family's experts are dropless
    lines = [
        "",
        f"mixture of experts: {count.routed} experts, top {count.top_k}, in {count.layers} of "
        f"{count.blocks} blocks"
        + (f", {e.shared_experts} shared" if e and e.shared_experts else "")
        + (f", capacity factor {e.capacity_factor}" if e and e.capacity_factor else ", dropless")
        + ":",
        f"  parameters     total {_count(count.total)}, active per token "
        f"{_count(count.active)} ({share:.0%}); routed experts {_count(count.experts)}",
        f"  per rank       {count.routed // ep} experts of each MoE block (expert_parallel {ep}), "
        f"sharded over {shard // ep} ranks: a gathered MoE block holds "
        f"{_count(count.per_layer / ep)} expert parameters" + ("" if ep > 1 else " (all of them)"),
    ]
    moved = all_to_all_bytes(count, tokens, accum, ep, itemsize, d_model)
    if ep > 1:
        lines.append(
            f"  all-to-all     {fmt_bytes(moved)} per rank and optimizer step (dispatch + "
            f"combine, forward + backward, {count.layers} layers x {accum} micro-batches)"
        )
    return lines
