"""The planner's MoE section (plan/experts.py): total against active parameters, the FLOPs per
token that MFU uses, the experts per rank and the all-to-all traffic of expert parallelism."""

from __future__ import annotations

import pytest

from bigtrain.model import model_flops_per_token, num_params
from bigtrain.model.gpt import GPT, flops_per_token
from bigtrain.model.moe import moe_layers
from bigtrain.plan.experts import all_to_all_bytes, count_experts
from bigtrain.plan.shapes import count_params
from tests.conftest import run_cli
from tests.model.test_moe import model_cfg

pytestmark = pytest.mark.unit


def test_active_parameters_count_top_k_of_each_blocks_experts():
    cfg = model_cfg(experts=4, top_k=1, first=1)  # blocks 1 and 2 are MoE
    model = GPT(cfg)
    total = sum(p.numel() for p in model.parameters())
    routed = [sum(p.numel() for p in m.experts.parameters()) for m in moe_layers(model)]
    count = count_experts(model)
    assert (count.total, count.experts, count.layers) == (total, sum(routed), 2)
    assert count.active == total - sum(r - r // 4 for r in routed)
    assert num_params(model, active=True) == count.active
    # MFU's FLOPs per token: 6 x the active non-embedding parameters (+ attention)
    active_body = num_params(model, non_embedding=True, active=True)
    assert active_body == num_params(model, non_embedding=True) - sum(r - r // 4 for r in routed)
    assert model_flops_per_token(model, cfg) == flops_per_token(cfg, active_body)
    # a gathered MoE block under ep=2 holds half its experts
    _, block = count_params(model)
    _, block_ep = count_params(model, ep=2)
    assert block - block_ep == routed[0] // 2
    assert count_experts(GPT(model_cfg(experts=0))) is None


def test_all_to_all_bytes_per_rank_and_step():
    cfg = model_cfg(experts=8, top_k=2)  # 3 MoE blocks, d_model 16
    # per layer and micro-batch: dispatch + combine, forward + backward, of 7/8 of the pairs
    expected = 4 * (1024 * 2 * 7 / 8) * 16 * 2 * 3 * 4
    count = count_experts(GPT(cfg))
    assert all_to_all_bytes(count, 1024, 4, 8, 2, cfg.d_model) == pytest.approx(expected)
    assert all_to_all_bytes(count, 1024, 4, 1, 2, cfg.d_model) == 0.0


def test_plan_prints_the_moe_recipes_split_and_traffic():
    result = run_cli("plan", "configs/moe-8b.yaml", "--world-size", "64", "--gpu-memory", "80GiB")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "mixture of experts: 16 experts, top 2, in 24 of 24 blocks, dropless" in out
    assert "total 8.05B, active per token 1.71B (21%)" in out
    assert "2 experts of each MoE block (expert_parallel 8), sharded over 8 ranks" in out
    assert "edp       (   8) all-gather" in out and "all-to-all" in out
    bad = run_cli("plan", "configs/moe-8b.yaml", "--world-size", "12")
    assert bad.returncode == 2
    assert "parallel.expert_parallel' (8) must divide the shard degree (12" in bad.stderr
