"""Where a model splits into pipeline stages, and each stage's part of it.

The split: stage s runs blocks [bounds[s], bounds[s + 1]). Given (parallel.pp_split) or balanced:
each block costs the mean of its share of the model's parameters (memory) and of its forward
FLOPs per token (time); the first stage also carries the embedding's parameters, the last the
final norm and the output layer's parameters and FLOPs. The contiguous split whose most
expensive stage is cheapest is found exactly (a small dynamic programme over blocks x stages).

A stage's module (`stage_module`) is a copy of the whole model's structure, still on the meta
device, with only that stage's parts kept: its blocks in a ModuleDict keyed by their index in the
whole model, so every parameter keeps the whole model's name (checkpoints, the monitor, telemetry
and the initial values all go by it). The last stage of a model with tied embeddings keeps the
token table as well (its output layer is that table); its gradient is summed with the first
stage's copy (parallel/pipeline.py).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from torch import nn

from bigtrain.model.gpt import GPT, num_params


@dataclass(frozen=True)
class StageCosts:
    """What the split balances: per block, and the extras of the first and last stage."""

    blocks: list[float]
    first: float
    last: float


def stage_costs(model: GPT) -> StageCosts:
    """Each part's cost: the mean of its parameter share and its forward-FLOP share (module
    docstring). `model` may be on the meta device."""
    cfg = model.cfg
    block_params = [num_params(b) for b in model.blocks]
    # Forward FLOPs per token: 2 per weight of each matmul, plus attention's scores and values
    # (2 x 2 x seq x d_model, the causal half not discounted, as in model.flops_per_token).
    attention = 4.0 * cfg.seq_len * cfg.d_model
    block_flops = [2.0 * n + attention for n in block_params]
    embed_params = model.tok_emb.weight.numel() + (
        model.pos_emb.weight.numel() if model.pos_emb is not None else 0
    )
    head_params = num_params(model.norm_f)
    tied = model.lm_head.weight is model.tok_emb.weight
    if not tied:
        head_params += model.lm_head.weight.numel()
    head_flops = 2.0 * model.lm_head.weight.numel()
    total_params = sum(block_params) + embed_params + head_params
    total_flops = sum(block_flops) + head_flops

    def cost(params: float, flops: float) -> float:
        return 0.5 * params / total_params + 0.5 * flops / total_flops

    return StageCosts(
        blocks=[cost(p, f) for p, f in zip(block_params, block_flops, strict=True)],
        first=cost(embed_params, 0.0),
        last=cost(head_params, head_flops),
    )


def balanced_bounds(costs: StageCosts, stages: int) -> list[int]:
    """The block boundaries [0, b1, ..., n] of the contiguous split into `stages` parts (each at
    least one block) whose most expensive part is cheapest; ties go to the earliest bounds."""
    n = len(costs.blocks)
    assert 1 <= stages <= n, "every stage needs a block (config/parallel.py checks)"
    prefix = [0.0]
    for c in costs.blocks:
        prefix.append(prefix[-1] + c)

    def part(s: int, a: int, b: int) -> float:  # stage s runs blocks [a, b)
        extra = (costs.first if s == 0 else 0.0) + (costs.last if s == stages - 1 else 0.0)
        return prefix[b] - prefix[a] + extra

    inf = float("inf")
    # best[s][b]: the cheapest maximum over stages 0..s with stage s ending at block b
    best = [[inf] * (n + 1) for _ in range(stages)]
    choice = [[0] * (n + 1) for _ in range(stages)]
    for b in range(1, n + 1):
        best[0][b] = part(0, 0, b)
    for s in range(1, stages):
        for b in range(s + 1, n + 1):
            for a in range(s, b):
                value = max(best[s - 1][a], part(s, a, b))
                if value < best[s][b] - 1e-15:
                    best[s][b], choice[s][b] = value, a
    bounds, b = [n], n
    for s in range(stages - 1, 0, -1):
        b = choice[s][b]
        bounds.append(b)
    return [0, *reversed(bounds)]


def stage_bounds(model: GPT, stages: int, split: list[int]) -> list[int]:
    """parallel.pp_split's bounds when given, else the balanced ones."""
    if split:
        return [0, *split, len(model.blocks)]
    return balanced_bounds(stage_costs(model), stages)


def stage_module(model: GPT, first_block: int, end_block: int, first: bool, last: bool) -> GPT:
    """A copy of `model` (on the meta device: nothing is allocated) that keeps blocks
    [first_block, end_block), the embeddings if `first`, the final norm and output layer if
    `last` (module docstring)."""
    assert all(p.is_meta for p in model.parameters()), "stages are cut from a meta-device model"
    stage = copy.deepcopy(model)
    stage.blocks = nn.ModuleDict(
        {str(i): stage.blocks[i] for i in range(first_block, end_block)}  # type: ignore[misc]
    )
    tied = model.lm_head.weight is model.tok_emb.weight
    stage.takes_tokens, stage.gives_logits = first, last
    if not first:
        stage.pos_emb = None
        if not (last and tied):  # the last stage's output layer is the tied table
            stage.tok_emb = None  # type: ignore[assignment]
    if not last:
        stage.norm_f = None  # type: ignore[assignment]
        stage.lm_head = None  # type: ignore[assignment]
    return stage


def stage_of_names(names: list[str], bounds: list[int]) -> dict[str, int]:
    """The stage whose copy of each of the GPT's parameters counts: a block's by its index, the
    embeddings the first stage's, the final norm and output layer the last's."""
    last = len(bounds) - 2
    out = {}
    for name in names:
        if name.startswith("blocks."):
            block = int(name.split(".")[1])
            out[name] = next(s for s in range(last + 1) if bounds[s] <= block < bounds[s + 1])
        else:
            out[name] = 0 if name.startswith(("tok_emb.", "pos_emb.")) else last
    return out
