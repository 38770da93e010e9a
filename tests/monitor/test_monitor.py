"""The monitor's numbers on one rank: the global norm, per-layer telemetry, non-finite counts,
replicated tensors counted once, max |g| on demand. Verdicts on them: tests/resilience/test_detect.py."""

import math

import pytest
import torch

from bigtrain.config.schema import MonitorConfig
from bigtrain.monitor.monitor import GradMonitor
from bigtrain.monitor.routers import ROUTER_EXTREMES, ROUTER_SUMS
from bigtrain.monitor.slots import HostValues, Slot

pytestmark = pytest.mark.unit

NAMES = ["tok_emb.weight", "blocks.0.attn.weight", "blocks.0.mlp.weight", "lm_head.weight"]


def grads(scale: float = 1.0, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    sizes = [(50, 8), (8, 8), (8, 16), (8, 50)]
    return [(n, torch.randn(s, generator=g) * scale) for n, s in zip(NAMES, sizes, strict=True)]


def monitor(replication=None) -> GradMonitor:
    return GradMonitor(MonitorConfig(), NAMES, torch.device("cpu"), False, replication)


def check(m: GradMonitor, named, loss: float = 2.0, full: bool = True, factor: float = 1.0):
    return m.check(named, torch.tensor(loss), factor, full=full)


def test_healthy_step_gives_the_global_norm_and_per_layer_telemetry():
    named = grads()
    h = check(monitor(), named)
    squares = [float(g.double().square().sum()) for _, g in named]
    assert h.loss_finite and h.grads_finite and h.num_nonfinite == 0
    assert h.host_grad_norm == pytest.approx(math.sqrt(sum(squares)), rel=1e-6)
    assert h.host_sum_sq == pytest.approx(squares, rel=1e-6)
    assert h.host_max_abs == pytest.approx([float(g.abs().max()) for _, g in named])
    layer_norm = h.telemetry["layer_grad_norm"]
    assert list(layer_norm) == ["tok_emb", "blocks.0", "lm_head"]
    assert layer_norm["blocks.0"] == pytest.approx(math.sqrt(squares[1] + squares[2]), rel=1e-6)
    cheap = check(monitor(), named, full=False)
    assert cheap.host_max_abs is None and "layer_grad_norm" not in cheap.telemetry


def test_a_nan_is_counted_per_tensor_and_max_abs_comes_on_demand():
    named = grads()
    named[2][1][3, 3] = float("nan")
    m = monitor()
    h = check(m, named, full=False)
    assert not h.grads_finite and h.num_nonfinite == 1 and h.host_nonfinite == [0, 0, 1, 0]
    max_abs = m.max_abs(named, 1.0)
    assert max_abs[2] == math.inf and max_abs[0] == pytest.approx(float(named[0][1].abs().max()))
    assert not check(m, grads(), loss=float("nan")).loss_finite


def test_numbers_are_unscaled_by_the_factor_the_gradients_still_carry():
    named = grads(scale=1024.0)
    h = check(monitor(), named, factor=1024.0)
    plain = check(monitor(), grads())
    assert h.host_grad_norm == pytest.approx(plain.host_grad_norm, rel=1e-6)
    assert h.host_max_abs == pytest.approx(plain.host_max_abs, rel=1e-6)
    assert h.grad_factor == 1024.0


def test_replicated_tensors_are_weighted_so_that_the_sum_over_ranks_counts_them_once():
    """HSDP: each of 2 replicas holds the same shards of tensors 0-2, so this rank's share of
    their squares (and non-finite counts) is a half; tensor 3 is its own (replication 1)."""
    named = grads()
    named[1][1][0, 0] = float("nan")
    h = check(monitor([2, 2, 2, 1]), named)
    squares = [float(g.double().square().sum()) for _, g in named]
    assert h.stats.sum_sq[0].item() == pytest.approx(squares[0] / 2, rel=1e-6)
    assert h.stats.sum_sq[3].item() == pytest.approx(squares[3], rel=1e-6)
    # half a NaN on this rank is still a NaN: counts round up to at least one
    assert h.num_nonfinite == 1 and h.host_nonfinite[1] == 0.5


class Routers:
    """An MoE model's router numbers, as RouterStats lays them out (monitor/routers.py)."""

    def slots(self) -> list[Slot]:
        return [Slot(ROUTER_SUMS, 2, "sum"), Slot(ROUTER_EXTREMES, 2, "max")]

    def take(self, device: torch.device) -> dict[str, torch.Tensor]:
        return {ROUTER_SUMS: torch.tensor([1.0, 2.0]), ROUTER_EXTREMES: torch.tensor([0.25, 0.5])}

    def read(self, host: HostValues) -> dict:
        return {"sums": host[ROUTER_SUMS], "extremes": host[ROUTER_EXTREMES]}


def test_across_groups_gets_and_gives_back_the_parts_that_cross_by_name():
    """A second replica group with loss 4, router sums [10, 10], extremes 0.75: the loss is
    averaged, sums summed, extremes maxed; the stop request and the gradient statistics, which
    are the group's own or equal in every group, are not passed."""
    passed = {}

    def across_groups(loss, summed, maxed):
        passed.update(summed=sorted(summed), maxed=sorted(maxed))
        summed = {k: v + 10.0 for k, v in summed.items()}
        return (loss + 4.0) / 2, summed, {k: v.clamp_min(0.75) for k, v in maxed.items()}

    cpu = torch.device("cpu")
    alone = GradMonitor(MonitorConfig(), NAMES, cpu, False, riders=[Routers()])
    grouped = GradMonitor(MonitorConfig(), NAMES, cpu, False, riders=[Routers()])
    grouped.across_groups = across_groups
    named = grads()
    h = grouped.check(named, torch.tensor(2.0), 1.0, full=True, stop_requested=True)
    assert passed == {"summed": [ROUTER_SUMS], "maxed": [ROUTER_EXTREMES]}
    assert h.host_loss == 3.0 and h.loss.item() == 3.0 and h.stop_requested
    assert h.telemetry["sums"] == [11.0, 12.0] and h.telemetry["extremes"] == [0.75, 0.75]
    plain = alone.check(named, torch.tensor(2.0), 1.0, full=True)
    assert h.host_sum_sq == plain.host_sum_sq and h.host_max_abs == plain.host_max_abs
    assert h.shards == plain.shards and h.host_grad_norm == plain.host_grad_norm


def test_the_fp8_rider_lays_out_every_layer_and_keeps_the_worse_run_of_a_step():
    """monitor/fp8.py: one row of FP8 statistics per layer of the whole model (zeros for a layer
    this rank does not hold), NaN sent as +inf (a MAX all-reduce keeps it), and the larger of a
    step's two runs (first run and replay) kept until the next step clears it."""
    from torch import nn

    from bigtrain.monitor.fp8 import FP8, Fp8Stats

    held = nn.Module()
    held.register_buffer("fp8_stats", torch.tensor([2.0, 0.0, float("nan"), 0.5]))
    layers = {"blocks.0.mlp.up": held, "blocks.1.mlp.up": held}
    stats = Fp8Stats(layers)
    del layers["blocks.1.mlp.up"]  # another pipeline stage's layer
    taken = stats.take(torch.device("cpu"))[FP8].reshape(-1)  # the pack flattens it
    assert taken.tolist() == [2.0, 0.0, float("inf"), 0.5, 0.0, 0.0, 0.0, 0.0]
    assert [s.size for s in stats.slots()] == [8] and stats.slots()[0].reduce == "max"
    stats.read(HostValues({FP8: [1.0, 0.0, 0.1, 0.0, 3.0, 1.0, 0.0, 0.0]}))
    stats.read(HostValues({FP8: [2.0, 0.0, 0.05, float("inf"), 0.0, 0.0, 0.2, 0.0]}))
    assert stats.rows == [[2.0, 0.0, 0.1, float("inf")], [3.0, 1.0, 0.2, 0.0]]
    stats.clear()
    assert stats.rows is None
