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

from bigtrain.config.model import moe_blocks
from bigtrain.config.schema import ModelConfig
from bigtrain.model.moe import Experts
from bigtrain.parallel.layout import Layout
from bigtrain.plan.comm import AxisTraffic, ring_bytes


@dataclass(frozen=True)
class ExpertCount:
    total: int  # every parameter
    experts: int  # the routed experts' (all MoE blocks)
    active: int  # per token: total - experts + top_k / experts of them
    layers: int  # MoE blocks
    per_layer: int  # one MoE block's routed experts


def count_experts(model: nn.Module, m: ModelConfig) -> ExpertCount | None:
    """The parameter counts of a (meta-device) MoE GPT; None for a dense model."""
    if not moe_blocks(m):
        return None
    stacks = [x for x in model.modules() if isinstance(x, Experts)]
    experts = sum(p.numel() for x in stacks for p in x.parameters())
    total = sum(p.numel() for p in model.parameters())
    active = total - experts + experts * m.moe.top_k // m.moe.experts
    return ExpertCount(total, experts, active, len(stacks), experts // len(stacks))


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def all_to_all_bytes(
    m: ModelConfig, tokens_per_micro_batch: int, accum: int, ep: int, itemsize: int
) -> float:
    """Bytes a rank sends (and receives) per optimizer step in the MoE layers' all-to-alls:
    per layer and micro-batch, dispatch and combine in forward and in backward, of the pairs
    whose expert is on another of the ep ranks (balanced routing)."""
    if ep <= 1:
        return 0.0
    pairs = tokens_per_micro_batch * m.moe.top_k * (ep - 1) / ep
    per_layer = 4 * pairs * m.d_model * itemsize  # (dispatch + combine) x (forward + backward)
    return per_layer * len(moe_blocks(m)) * accum


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
    fmt_bytes,
) -> list[str]:
    """The plan's MoE section; nothing for a dense model."""
    if count is None:
        return []
    e = m.moe
    share = count.active / count.total
    lines = [
        "",
        f"mixture of experts: {e.experts} experts, top {e.top_k}, in {count.layers} of "
        f"{m.n_layers} blocks"
        + (f", {e.shared_experts} shared" if e.shared_experts else "")
        + (f", capacity factor {e.capacity_factor}" if e.capacity_factor else ", dropless")
        + ":",
        f"  parameters     total {_count(count.total)}, active per token "
        f"{_count(count.active)} ({share:.0%}); routed experts {_count(count.experts)}",
        f"  per rank       {e.experts // ep} experts of each MoE block (expert_parallel {ep}), "
        f"sharded over {shard // ep} ranks: a gathered MoE block holds "
        f"{_count(count.per_layer / ep)} expert parameters" + ("" if ep > 1 else " (all of them)"),
    ]
    moved = all_to_all_bytes(m, tokens, accum, ep, itemsize)
    if ep > 1:
        lines.append(
            f"  all-to-all     {fmt_bytes(moved)} per rank and optimizer step (dispatch + "
            f"combine, forward + backward, {count.layers} layers x {accum} micro-batches)"
        )
    return lines
