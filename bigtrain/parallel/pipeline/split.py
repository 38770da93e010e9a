"""Where a model splits into pipeline stages, and each stage's part of it.

The split: stage s runs blocks [bounds[s], bounds[s + 1]). Given (parallel.pp_split) or balanced:
each block costs the mean of its share of the model's parameters (memory) and of its forward
FLOPs per token (time); the first stage also carries the embedding's parameters, the last the
final norm and the output layer's parameters and FLOPs. The contiguous split whose most
expensive stage is cheapest is found exactly (a small dynamic programme over blocks x stages).

A stage's module (`stage_module`) is a copy of the whole model with only that stage's parts kept:
its blocks in a ModuleDict keyed by their index in the whole model, so every parameter keeps the
whole model's name (checkpoints, the monitor, telemetry and the initial values all go by it).
bigtrain's GPT is cut on the meta device (each stage then draws its own parameters by name, as a
whole build would); a transformers model (`HFStage`: every family that declares a pipeline
plan, and GPT-2 by bigtrain's own) is cut from its whole build, which transformers initialises
as a whole. The last stage of a model with tied
embeddings keeps the token table as well (its output layer is that table); its gradient is summed
with the first stage's copy (parallel/pipeline/schedule.py).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from torch import nn

from bigtrain.model.gpt import GPT, num_params
from bigtrain.model.hf import HFCausalLM, HFStage
from bigtrain.model.hf_plans import family_plans, require


@dataclass(frozen=True)
class StageSpec:
    """Where a model's parts are: the block container, and the modules only the first stage
    (embeddings) and only the last stage (final norm, then the output layer) run."""

    blocks: str
    first: tuple[str, ...]
    last: tuple[str, ...]
    family: str = "gpt"


def stage_spec(model: nn.Module) -> StageSpec:
    if isinstance(model, GPT):
        return StageSpec("blocks", ("tok_emb", "pos_emb"), ("norm_f", "lm_head"))
    assert isinstance(model, HFCausalLM), "bigtrain's GPT or a transformers causal LM"
    plans = family_plans(model.hf)
    require(plans, "parallel.pipeline_parallel")  # (the planner splits too)
    assert plans.stages is not None
    blocks, first, last = plans.stages
    return StageSpec(blocks, first, last, "gpt2" if plans.own else "declared")


def _present(model: nn.Module, paths: tuple[str, ...]) -> list[nn.Module]:
    out = []
    for path in paths:
        parent, _, attr = path.rpartition(".")
        module = getattr(model.get_submodule(parent) if parent else model, attr, None)
        if module is not None:
            out.append(module)
    return out


def _params(modules: list[nn.Module]) -> dict[int, nn.Parameter]:
    return {id(p): p for m in modules for p in m.parameters()}


def end_params(model: nn.Module) -> tuple[int, int]:
    """(parameters only the first stage holds, parameters the last stage holds besides its
    blocks): a tied table counts in both."""
    spec = stage_spec(model)
    first = _params(_present(model, spec.first))
    last = _params(_present(model, spec.last))
    return sum(p.numel() for p in first.values()), sum(p.numel() for p in last.values())


def block_modules(model: nn.Module) -> list[nn.Module]:
    """The model's blocks in order (the container stage_spec names)."""
    return list(model.get_submodule(stage_spec(model).blocks).children())


@dataclass(frozen=True)
class StageCosts:
    """What the split balances: per block, and the extras of the first and last stage."""

    blocks: list[float]
    first: float
    last: float


def stage_costs(model: nn.Module, seq_len: int) -> StageCosts:
    """Each part's cost: the mean of its parameter share and its forward-FLOP share (module
    docstring). `model` may be on the meta device."""
    spec = stage_spec(model)
    blocks = list(model.get_submodule(spec.blocks).children())
    block_params = [num_params(b) for b in blocks]
    first = _params(_present(model, spec.first))
    last = {k: p for k, p in _params(_present(model, spec.last)).items() if k not in first}
    embed_params = sum(p.numel() for p in first.values())
    head_params = sum(p.numel() for p in last.values())
    output = _present(model, spec.last[-1:])[0].weight  # (vocab, d_model)
    d_model = output.shape[1]
    # Forward FLOPs per token: 2 per weight of each matmul, plus attention's scores and values
    # (2 x 2 x seq x d_model, the causal half not discounted, as in model.flops_per_token).
    attention = 4.0 * seq_len * d_model
    block_flops = [2.0 * n + attention for n in block_params]
    head_flops = 2.0 * output.numel()
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


def stage_bounds(model: nn.Module, stages: int, split: list[int], seq_len: int) -> list[int]:
    """parallel.pp_split's bounds when given, else the balanced ones."""
    if split:
        n = len(model.get_submodule(stage_spec(model).blocks))
        return [0, *split, n]
    return balanced_bounds(stage_costs(model, seq_len), stages)


def stage_module(
    model: nn.Module, first_block: int, end_block: int, first: bool, last: bool
) -> nn.Module:
    """A copy of `model` that keeps blocks [first_block, end_block), the embeddings if `first`,
    the final norm and output layer if `last` (module docstring): a GPT with takes_tokens and
    gives_logits set, or an HFStage."""
    spec = stage_spec(model)
    stage = copy.deepcopy(model)
    parent_path, _, attr = spec.blocks.rpartition(".")
    parent = stage.get_submodule(parent_path) if parent_path else stage
    blocks = getattr(parent, attr)
    kept = {str(i): blocks[i] for i in range(first_block, end_block)}
    setattr(parent, attr, StageBlocks(kept, len(blocks)))
    output = _present(stage, spec.last[-1:])[0]
    tied = {id(output.weight)}
    for path in spec.first if not first else ():
        module = _present(stage, (path,))
        if module and not (last and id(getattr(module[0], "weight", None)) in tied):
            _drop(stage, path)  # (the last stage's output layer keeps a tied table)
    for path in spec.last if not last else ():
        # a transformers body runs its final norm whatever the stage: there, it passes through
        is_norm = spec.family == "declared" and path != spec.last[-1]
        _drop(stage, path, nn.Identity() if is_norm else None)
    if isinstance(stage, GPT):
        stage.takes_tokens, stage.gives_logits = first, last
        return stage
    return HFStage(stage.hf, spec.family, first, last)


def _drop(model: nn.Module, path: str, keep: nn.Module | None = None) -> None:
    parent, _, attr = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, keep)


class StageBlocks(nn.ModuleDict):
    """A stage's blocks, keyed by their index in the whole model (so every parameter keeps its
    whole-model name). Iterated or sliced, it is the whole model's list with every other stage's
    block passing its input through: a transformers body's own forward (`for i, layer in
    enumerate(self.layers[:n])`, some reading the layer's type by `i`) runs exactly this stage's
    layers, each at its own index. Its length, keys and values are this stage's blocks only."""

    def __init__(self, blocks: dict[str, nn.Module], total: int) -> None:
        super().__init__(blocks)
        self.total = total

    def _whole(self) -> list:
        return [self._modules.get(str(i), _pass_through) for i in range(self.total)]

    def __iter__(self):
        return iter(self._whole())

    def __getitem__(self, key):  # type: ignore[override]
        if isinstance(key, slice):
            return self._whole()[key]
        return super().__getitem__(str(key))


def _pass_through(hidden_states, *args, **kwargs):  # noqa: ARG001
    """Another stage's block: its input unchanged."""
    return hidden_states


def stage_of_names(model: nn.Module, bounds: list[int]) -> dict[str, int]:
    """The stage whose copy of each parameter counts (by its name in named_parameters, which
    lists a tied table once, under the embedding): a block's by its index, the embeddings the
    first stage's, the final norm and output layer the last's."""
    spec = stage_spec(model)
    last = len(bounds) - 2
    prefix = spec.blocks + "."
    out = {}
    for name, _ in model.named_parameters():
        if name.startswith(prefix):
            block = int(name[len(prefix) :].split(".")[0])
            out[name] = next(s for s in range(last + 1) if bounds[s] <= block < bounds[s + 1])
        else:
            out[name] = 0 if name.startswith(tuple(p + "." for p in spec.first)) else last
    return out
