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


def monitor(**overrides) -> GradMonitor:
    cfg = MonitorConfig(**{"warmup": 5, "window": 20, **overrides})
    return GradMonitor(cfg, NAMES, torch.device("cpu"), use_kernel=False)


def check(m: GradMonitor, named, loss: float = 2.0, full: bool = True, loss_scaled=False):
    return m.check(named, torch.tensor(loss), 1.0, full=full, loss_scaled=loss_scaled)


def test_healthy_step_gives_the_global_norm_and_per_layer_telemetry():
    named = grads()
    h = check(monitor(), named)
    expected = math.sqrt(sum(float(g.double().square().sum()) for _, g in named))
    assert h.anomaly is None and not h.skip and h.finite
    assert h.grad_norm.item() == pytest.approx(expected, rel=1e-6)
    assert h.host_grad_norm == pytest.approx(expected, rel=1e-6) and h.host_loss == 2.0
    assert list(h.telemetry["layer_grad_norm"]) == ["tok_emb", "blocks.0", "lm_head"]
    block = math.sqrt(sum(float(g.double().square().sum()) for _, g in named[1:3]))
    assert h.telemetry["layer_grad_norm"]["blocks.0"] == pytest.approx(block, rel=1e-6)
    assert h.telemetry["layer_grad_max"]["lm_head"] == pytest.approx(float(named[3][1].abs().max()))
    assert h.telemetry["grad_nonfinite"] == 0
    assert "layer_grad_norm" not in check(monitor(), named, full=False).telemetry


def test_a_nan_is_an_anomaly_that_names_the_poisoned_tensor():
    named = grads()
    named[2][1][3, 4] = float("nan")
    h = check(monitor(), named, full=False)  # found on a cheap step; the report is full anyway
    a = h.anomaly
    assert h.skip and not h.finite and a.kind == "nonfinite" and a.metric == "grads"
    assert a.tensor == "blocks.0.mlp.weight" and a.top_nonfinite == [["blocks.0.mlp.weight", 1]]
    assert a.top_max_abs[0][0] == "blocks.0.mlp.weight" and a.top_max_abs[0][1] == float("inf")
    assert h.telemetry["grad_nonfinite"] == 1


def test_nonfinite_gradients_under_loss_scaling_are_an_overflow_not_an_anomaly():
    named = grads()
    named[0][1][0, 0] = float("inf")
    h = check(monitor(), named, loss_scaled=True)
    assert h.overflow and h.skip and h.anomaly is None and not h.finite
    nan_loss = check(monitor(), grads(), loss=float("nan"), loss_scaled=True)
    assert not nan_loss.overflow and nan_loss.anomaly.metric == "loss"


@pytest.mark.parametrize("on_spike", ["skip", "warn"])
def test_a_tensor_spike_after_warmup_is_an_anomaly_naming_the_tensor(on_spike):
    m = monitor(on_spike=on_spike)
    for seed in range(8):
        assert check(m, grads(seed=seed)).anomaly is None
    window = len(m.detectors["tensor_max"].values)
    named = grads(seed=99)
    named[1][1].mul_(50.0)
    h = check(m, named)
    a = h.anomaly
    assert a.kind == "spike" and h.skip == (on_spike == "skip")
    assert {s["metric"] for s in a.spikes} >= {"tensor_max"}
    tensor_spike = next(s for s in a.spikes if s["metric"] == "tensor_max")
    assert tensor_spike["tensor"] == "blocks.0.attn.weight"
    assert a.top_max_abs[0][0] == "blocks.0.attn.weight"
    assert len(m.detectors["tensor_max"].values) == window  # spikes never join the window


def test_loss_spike_fires_only_after_warmup():
    m = monitor(spikes=["loss"])
    assert check(m, grads(), loss=50.0).anomaly is None  # warm-up: the first value is no spike
    m = monitor(spikes=["loss"])
    for i in range(6):
        assert check(m, grads(), loss=2.0 + 0.01 * i).anomaly is None
    a = check(m, grads(), loss=20.0).anomaly
    assert a.kind == "spike" and a.metric == "loss" and a.value == 20.0 and a.threshold < 2.1


def test_state_dict_restores_the_windows():
    m = monitor()
    for seed in range(6):
        check(m, grads(seed=seed), loss=2.0 + seed * 0.01)
    n = monitor()
    n.load_state_dict(m.state_dict())
    for metric in m.detectors:
        assert [v.tolist() for v in n.detectors[metric].values] == [
            v.tolist() for v in m.detectors[metric].values
        ]


def test_replicated_tensors_are_weighted_so_that_the_sum_over_ranks_counts_them_once():
    """HSDP: each of 2 replicas holds the same shards of tensors 0-2, so this rank's share of
    their squares (and non-finite counts) is a half; tensor 3 is its own (replication 1)."""
    named = grads()
    named[1][1][0, 0] = float("nan")
    m = GradMonitor(
        MonitorConfig(warmup=5, window=20), NAMES, torch.device("cpu"), False, [2, 2, 2, 1]
    )
    h = check(m, named)
    squares = [float(g.double().square().sum()) for _, g in named]
    assert h.stats.sum_sq[0].item() == pytest.approx(squares[0] / 2, rel=1e-6)
    assert h.stats.sum_sq[3].item() == pytest.approx(squares[3], rel=1e-6)
    # half a NaN on this rank is still a NaN: counts round up to at least one
    assert h.num_nonfinite == 1 and h.anomaly.top_nonfinite == [["blocks.0.attn.weight", 1]]
