"""The planner under context parallelism: activations divided by cp, the ring's and the
all-to-all's traffic by hand, the proposal's cp candidates, and the long-context recipe."""

from __future__ import annotations

import pytest

from bigtrain.config import load_config
from bigtrain.plan.comm import cp_traffic
from bigtrain.plan.footprint import planned
from bigtrain.plan.proposal import candidates, cp_degrees, proposal_lines
from bigtrain.plan.shapes import count_params, meta_model
from bigtrain.plan.stages import rank_loads
from bigtrain.plan.step_time import step_time
from bigtrain.plan.text import fmt_bytes, plan_text
from tests.plan.test_footprint import CPU

pytestmark = pytest.mark.unit

GIB = 2**30


def test_cp_traffic_by_hand():
    """ring, cp 4, 2 layers, 3 forwards and 2 backwards a step, 1000 tokens a rank, key/value
    width 64 in 2 bytes: a forward passes k and v on 3 times; a backward passes them 3 times and
    their FP32 gradients 4 times."""
    ring = cp_traffic("ring", 4, 2, (3, 2), 1000, (256, 64), 2)
    forward = 3 * 2 * 64 * 2
    backward = forward + 4 * 2 * 64 * 4
    assert ring.bytes_per_step == 2 * 1000 * (3 * forward + 2 * backward)
    assert ring.collective == f"ring send/recv x {2 * (3 * 3 + 2 * 7)}"
    # all-to-all: q, k, v and the output, 3/4 of each leaving the rank, per pass
    a2a = cp_traffic("all_to_all", 4, 2, (3, 2), 1000, (256, 64), 2)
    assert a2a.bytes_per_step == pytest.approx(2 * 1000 * 5 * 0.75 * (2 * 256 + 2 * 64) * 2)
    assert a2a.collective == "all-to-all x 40"


def test_activations_are_divided_by_cp_and_the_step_counts_its_traffic():
    base = ["configs/llama-8b-128k.yaml"]
    a2a = ["parallel.tensor_parallel=1", "parallel.cp_style=all_to_all"]
    cfg = load_config(base, [*a2a, "parallel.context_parallel=8"])
    one = planned(load_config(base, [*a2a, "parallel.context_parallel=1"]), 8, CPU)
    eight = planned(cfg, 64, CPU)
    assert (eight.layout.cp, eight.layout.shard, eight.activation_split) == (8, 8, 8)
    act_one, act_eight = rank_loads(one)[0].activation_bytes, rank_loads(eight)[0].activation_bytes
    assert act_eight == pytest.approx(act_one / 8)
    step = step_time(eight)
    assert step.parts["cp"] > 0 and "cp" not in step_time(one).parts
    text = plan_text(eight, 80 * GIB)
    assert "split 8 ways (cp 8)" in text and "mesh shard 8 x cp 8" in text
    assert "  cp        (   8) all-to-all x 384" in text


def test_the_long_context_recipe_fits_80gb_and_the_proposal_weighs_cp_against_tp():
    cfg = load_config(["configs/llama-8b-128k.yaml"])
    assert count_params(meta_model(cfg.model, cfg.data))[0] == 8_030_261_248  # Llama 3.1 8B
    run = planned(cfg, 64, CPU)
    peak = max(load.total_bytes for load in rank_loads(run))
    assert peak < 80 * GIB - (GIB + 4 * GIB)  # beside the planner's reserve
    assert cp_degrees(131072) == [1, 2, 4, 8, 16] and cp_degrees(8192) == [1]
    cands = candidates(run, 64, 80 * GIB)
    with_cp = [c for c in cands if c.cp > 1 and not c.rejected]
    assert {c.cp for c in with_cp} >= {4, 8, 16}
    assert any(c.tp > 1 for c in with_cp)  # tp x cp
    lines = proposal_lines(run, 64, 80 * GIB, fmt_bytes)
    # the recipe carries the proposal
    p = cfg.parallel
    keys = f"parallel.tensor_parallel={p.tensor_parallel} train.micro_batch_size=1 "
    keys += f"parallel.context_parallel={p.context_parallel} parallel.cp_style={p.cp_style} "
    assert lines[-2].startswith(f"  proposed: {keys}("), lines[-2]
    verdict = lines[-1]
    assert verdict.startswith("  at 131072 tokens ") and (
        "cp beats tp" in verdict or "tp beats cp" in verdict
    )
    short = planned(load_config(["configs/llama-7b.yaml"]), 64, CPU)
    assert proposal_lines(short, 64, 80 * GIB, fmt_bytes)[-1] == (
        "  cp not considered: 4096-token sequences (cp from 16384)"
    )
