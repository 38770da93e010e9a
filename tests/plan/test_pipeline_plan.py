"""The pipeline split and the planner's pipeline numbers: the balanced split against brute force,
the bubble and in-flight formulas, the per-rank loads against the model, and the layout proposal
for the recipes."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
import torch

from bigtrain.config import load_config
from bigtrain.model import build_model, num_params
from bigtrain.parallel.pipeline.schedule import rank_stages, stage_rank, tied_table
from bigtrain.parallel.pipeline.split import (
    StageCosts,
    balanced_bounds,
    stage_bounds,
    stage_module,
    stage_of_names,
)
from bigtrain.plan.footprint import planned
from bigtrain.plan.proposal import candidates, proposal
from bigtrain.plan.stages import bubble_fraction, in_flight, planned_memory, rank_loads
from bigtrain.precision import Hardware
from tests.conftest import run_cli

ROOT = Path(__file__).resolve().parents[2]
GPU = Hardware("cuda", "an sm90 GPU (planned)", cuda_capability=(9, 0))
pytestmark = pytest.mark.unit


def brute_force(costs: StageCosts, stages: int) -> float:
    n = len(costs.blocks)
    best = float("inf")
    for cut in itertools.combinations(range(1, n), stages - 1):
        bounds = [0, *cut, n]
        parts = [sum(costs.blocks[a:b]) for a, b in itertools.pairwise(bounds)]
        parts[0] += costs.first
        parts[-1] += costs.last
        best = min(best, max(parts))
    return best


def test_the_balanced_split_is_the_best_contiguous_one():
    rng = random.Random(0)
    for _ in range(30):
        n = rng.randint(2, 9)
        stages = rng.randint(1, n)
        costs = StageCosts([rng.random() for _ in range(n)], rng.random(), rng.random())
        bounds = balanced_bounds(costs, stages)
        assert bounds[0] == 0 and bounds[-1] == n and len(bounds) == stages + 1
        assert all(a < b for a, b in itertools.pairwise(bounds))  # every stage has a block
        parts = [sum(costs.blocks[a:b]) for a, b in itertools.pairwise(bounds)]
        parts[0] += costs.first
        parts[-1] += costs.last
        assert max(parts) == pytest.approx(brute_force(costs, stages))
    # the output layer's cost moves blocks off the last stage
    assert balanced_bounds(StageCosts([1.0] * 8, 0.0, 2.0), 2) == [0, 5, 8]


def _gpt(*overrides: str):
    cfg = load_config([str(ROOT / "configs/tiny.yaml")], list(overrides)).model
    with torch.device("meta"):
        return build_model(cfg, 2048, init_seed=None)


def test_stages_keep_the_whole_models_names_and_parameters():
    model = _gpt("model.n_layers=6")
    bounds = stage_bounds(model, 3, [], 128)
    assert stage_bounds(model, 3, [1, 4], 128) == [0, 1, 4, 6]  # parallel.pp_split
    stages = [stage_module(model, bounds[s], bounds[s + 1], s == 0, s == 2) for s in range(3)]
    whole = dict(model.named_parameters())
    seen: dict[str, int] = {}
    for s, stage in enumerate(stages):
        for name, p in stage.named_parameters():
            assert whole[name].shape == p.shape, name
            seen.setdefault(name, s)
    assert set(seen) == set(whole)  # every parameter on some stage, under its own name
    # the tied table: on the first stage (counted) and the last (its output layer)
    assert tied_table(model) == "tok_emb.weight"
    assert "tok_emb.weight" in dict(stages[2].named_parameters())
    assert "tok_emb.weight" not in dict(stages[1].named_parameters())
    owners = stage_of_names(model, bounds)
    assert owners["tok_emb.weight"] == 0 and owners["norm_f.weight"] == 2
    assert owners[f"blocks.{bounds[1]}.attn.q.weight"] == 1


def test_stage_ranks_loop_and_v():
    assert rank_stages("1f1b", 4, 1, 2) == [2]
    assert rank_stages("interleaved_1f1b", 2, 3, 1) == [1, 3, 5]
    assert rank_stages("zbv", 4, 2, 1) == [1, 6]
    assert [stage_rank("zbv", 2, 2, s) for s in range(4)] == [0, 1, 1, 0]


def test_bubble_and_in_flight_formulas():
    assert bubble_fraction("1f1b", 4, 1, 12) == pytest.approx(3 / 15)
    assert bubble_fraction("gpipe", 4, 1, 12) == pytest.approx(3 / 15)
    assert bubble_fraction("interleaved_1f1b", 4, 2, 12) == pytest.approx(3 / 27)
    assert bubble_fraction("zbv", 4, 2, 8) == 0.0  # m >= 2 pp
    assert bubble_fraction("1f1b", 1, 1, 3) == 0.0
    assert in_flight("gpipe", 4, 1, 12, 0) == 12
    assert [in_flight("1f1b", 4, 1, 12, r) for r in range(4)] == [4, 3, 2, 1]
    # Megatron's warm-up: 2 (pp - r - 1) + (V - 1) pp + 1 chunk forwards, each 1/V of the layers
    assert in_flight("interleaved_1f1b", 4, 2, 12, 0) == pytest.approx((6 + 4 + 1) / 2)


def test_rank_loads_hold_the_model_once_and_the_tied_table_twice():
    cfg = load_config(
        [str(ROOT / "configs/tiny.yaml")],
        ["model.n_layers=8", "parallel.pipeline_parallel=4", "parallel.backend=fsdp"],
    )
    run = planned(cfg, 8, GPU)
    loads = rank_loads(run)
    table = run.model.tok_emb.weight.numel()
    assert [load.blocks for load in loads][0][0][0] == 0 and loads[-1].blocks[-1][1] == 8
    assert sum(load.params for load in loads) == num_params(run.model) + table
    assert [load.in_flight for load in loads] == [4, 3, 2, 1]  # 1f1b, 16 micro-batches
    memory = planned_memory(run)
    worst = max(loads, key=lambda r: r.total_bytes)
    assert memory["pp_rank"] == worst.pp_rank and memory["total_bytes"] == int(worst.total_bytes)


def test_the_405b_recipe_is_the_proposal_at_16384_gpus():
    cfg = load_config([str(ROOT / "configs/llama-405b.yaml")], [])
    run = planned(cfg, 16384, GPU, global_batch=False)
    cands = candidates(run, 16384, 80 * 2**30)
    best = proposal(cands)
    assert best is not None
    assert (best.tp, best.pp, best.chunks) == (
        cfg.parallel.tensor_parallel,
        cfg.parallel.pipeline_parallel,
        cfg.parallel.pp_stages_per_rank,
    )
    flat = [c for c in cands if c.pp == 1 and not c.rejected]
    assert flat and all(c.step_s > best.step_s for c in flat)  # stages beat FSDP2 alone here
    # each data-parallel rank takes the recipe's micro-batch: the global batch is kept
    assert best.micro_batches == cfg.train.micro_batch_size
    assert best.dp * best.micro_batches == cfg.train.global_batch_size


def test_propose_needs_the_gpu_memory_and_explains_an_impossible_batch():
    result = run_cli(
        "plan", str(ROOT / "configs/llama-70b.yaml"), "--world-size", "64", "--propose"
    )
    assert result.returncode == 2 and "--propose needs --gpu-memory" in result.stderr
    result = run_cli(
        "plan",
        str(ROOT / "configs/llama-70b.yaml"),
        "--world-size",
        "16384",
        "--gpu-memory",
        "80GiB",
        "--propose",
    )
    assert result.returncode == 0, result.stderr
    assert "none works" in result.stdout and "raise train.global_batch_size" in result.stdout
