"""The router numbers the monitor reduces (monitor/routers.py) and the culprit a router rule
names (resilience/detect.py)."""

from __future__ import annotations

import math

import pytest
import torch

from bigtrain.model.gpt import GPT
from bigtrain.monitor.routers import ROUTER_EXTREMES, ROUTER_SUMS, RouterStats
from bigtrain.monitor.slots import HostValues
from bigtrain.resilience.detect import ROUTER_SERIES, ROUTER_VALUES, _router_of
from tests.model.test_moe import model_cfg

pytestmark = pytest.mark.unit


def test_take_lays_out_every_block_and_clears_read_derives_the_metrics():
    model = GPT(model_cfg(first=1))  # blocks 1 and 2 are MoE, 4 experts
    stats = RouterStats.of([model], ["blocks.0", "blocks.1", "blocks.2"], 4)
    assert set(stats.layers) == {"blocks.1", "blocks.2"}  # blocks.0: another stage's, say
    std = [0.1, 0.1, 0.2, 0.4]  # summed over the 2 forwards: means 0.05, 0.05, 0.1, 0.2
    model.blocks[1].moe.stats.copy_(torch.tensor([8.0, 8, 8, 8, 2.0, 0.5, 0, 2, *std]))
    model.blocks[2].moe.stats.copy_(torch.tensor([30.0, 2, 0, 0, 6.0, 3.0, 4, 2, *std]))
    # importance per expert: largest of a forward, then 1 - smallest
    model.blocks[1].moe.extremes.copy_(torch.tensor([0.3, 0.3, 0.25, 0.25, 0.8, 0.75, 0.75, 0.8]))
    model.blocks[2].moe.extremes.copy_(torch.tensor([0.6, 0.2, 0.2, 0.3, 0.6, 0.9, 0.8, 0.8]))
    taken = stats.take(torch.device("cpu"))
    vector, extremes = taken[ROUTER_SUMS], taken[ROUTER_EXTREMES]
    assert vector.shape == (3 * 12,) and vector[:12].sum() == 0
    assert extremes.shape == (3 * 8,) and extremes[:8].sum() == 0
    assert all(m.moe.stats.sum() == 0 for m in model.blocks[1:])  # cleared for the next step
    assert all(m.moe.extremes.sum() == 0 for m in model.blocks[1:])
    out = stats.read(HostValues({k: v.tolist() for k, v in taken.items()}))
    assert set(out["moe_layer_load"]) == {"blocks.1", "blocks.2"}
    assert out["moe_layer_load_max_mean"] == {"blocks.1": 1.0, "blocks.2": 30 / 32 * 4}
    assert out["moe_load_max_mean"] == 30 / 32 * 4
    shares = [30 / 32, 2 / 32]
    entropy = -sum(s * math.log(s) for s in shares) / math.log(4)
    assert out["moe_load_entropy"] == pytest.approx(entropy)
    assert out["moe_layer_aux_loss"] == {"blocks.1": 1.0, "blocks.2": 3.0}  # over 2 forwards
    assert out["moe_aux_loss"] == 2.0 and out["moe_aux_loss_max"] == 3.0
    assert out["moe_z_loss_max"] == 1.5 and out["moe_dropped"] == 4
    # ranges per expert over mean score std: block 1 (0.1, 0.05, 0, 0.05) / (0.05, 0.05, 0.1,
    # 0.2) -> 2.0 (expert 0); block 2 (0.2, 0.1, 0, 0.1) -> 4.0 (expert 0)
    assert out["moe_layer_router_spread"] == pytest.approx({"blocks.1": 2.0, "blocks.2": 4.0})
    assert out["moe_router_spread"] == pytest.approx(4.0)
    # the router rules read what `read` writes (the names are routers.py's)
    assert {*ROUTER_VALUES.values(), *ROUTER_SERIES.values()} <= set(out)
    assert RouterStats.of([model], [], 4) is None


def test_a_router_rule_names_the_router_of_the_worst_block():
    telemetry = {
        "moe_layer_aux_loss": {"blocks.1": 1.0, "blocks.2": 3.0},
        "moe_layer_z_loss": {"blocks.1": 9.0, "blocks.2": 2.0},
        "moe_layer_router_spread": {"blocks.1": 0.5, "blocks.2": 40.0},
    }
    assert _router_of("router_collapse", telemetry) == "blocks.2.moe.router.weight"
    assert _router_of("router_logits", telemetry) == "blocks.1.moe.router.weight"
    assert _router_of("router_spread", telemetry) == "blocks.2.moe.router.weight"
    assert _router_of("loss", telemetry) is None
