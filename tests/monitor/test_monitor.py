"""The monitor's numbers on one rank: the global norm, per-layer telemetry, non-finite counts,
replicated tensors counted once, max |g| on demand. Verdicts on them: tests/resilience/test_detect.py."""

import math

import pytest
import torch

from bigtrain.config.schema import MonitorConfig
from bigtrain.monitor.monitor import GradMonitor

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
