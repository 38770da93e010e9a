import math

import pytest
import torch

from bigtrain.monitor.detectors import SpikeDetector
from bigtrain.monitor.stats import local_grad_stats, reduce_grad_stats, top_tensors
from tests.distributed import run_distributed


def reference(t: torch.Tensor) -> tuple[float, float, int]:
    x = t.double()
    finite = torch.isfinite(x)
    nonfinite = int((~finite).sum())
    if t.numel() == 0:
        return 0.0, 0.0, 0
    max_abs = float(x.abs().max()) if not torch.isnan(x).any() else float("nan")
    return max_abs, float((x * x).sum()), nonfinite


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_stats_against_a_float64_reference(dtype):
    torch.manual_seed(0)
    grads = [
        torch.randn(1000, 3).to(dtype),
        torch.randn(7).to(dtype),
        torch.empty(0, dtype=dtype),
        torch.randn(33, 5).to(dtype),
        torch.randn(257).to(dtype),
    ]
    grads[3][2, 1] = float("nan")
    grads[4][-1] = float("inf")
    stats = local_grad_stats([(f"t{i}", g) for i, g in enumerate(grads)], torch.device("cpu"))
    for i, g in enumerate(grads):
        max_abs, sum_sq, nonfinite = reference(g)
        assert stats.nonfinite[i].item() == nonfinite
        if nonfinite:
            assert not math.isfinite(stats.sum_sq[i].item())
            continue
        assert stats.max_abs[i].item() == pytest.approx(max_abs, rel=1e-6)
        assert stats.sum_sq[i].item() == pytest.approx(sum_sq, rel=1e-5)
    top = top_tensors(stats, k=2)
    assert {n for n, _ in top["nonfinite"]} == {"t3", "t4"}


def shard_stats(shard_of: int) -> tuple[list, list, list, float]:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    full = [torch.randn(100), torch.randn(40, 3)]
    full[1][5, 2] = float("nan")
    named = [
        (f"t{i}", t.flatten().chunk(2)[rank]) for i, t in enumerate(full)
    ]  # each rank: half of each
    stats, loss = reduce_grad_stats(
        local_grad_stats(named, torch.device("cpu")), torch.tensor(float(rank + 1))
    )
    dist.destroy_process_group()
    return stats.max_abs.tolist(), stats.sum_sq.tolist(), stats.nonfinite.tolist(), loss.item()


def test_sharded_stats_reduce_to_the_full_tensors_on_every_rank():
    r0, r1 = run_distributed(shard_stats, 2, 0)
    assert r0 == r1 or (math.isnan(r0[1][1]) and r0[0] == r1[0] and r0[2] == r1[2])
    torch.manual_seed(0)
    full = torch.randn(100)
    assert r0[0][0] == pytest.approx(full.abs().max().item())
    assert r0[1][0] == pytest.approx((full.double() ** 2).sum().item(), rel=1e-5)
    assert r0[2] == [0.0, 1.0]  # the NaN in rank 0's half of t1 is seen by both ranks
    assert r0[0][1] == float("inf")
    assert r0[3] == 1.5  # mean of the ranks' losses 1 and 2


@pytest.mark.parametrize("method", ["mean_std", "median_mad"])
def test_spike_detector_fires_after_warmup_only(method):
    d = SpikeDetector("loss", window=100, k=3.0, method=method, warmup=20)
    values = [1.0 + 0.01 * math.sin(i) for i in range(30)]
    assert d.update(10.0) is None  # a 10x value during warm-up does not fire (and is kept)
    d = SpikeDetector("loss", window=100, k=3.0, method=method, warmup=20)
    for v in values:
        assert d.update(v) is None
    spike = d.update(10.0)
    assert spike is not None and spike.value == 10.0 and spike.threshold < 1.1
    assert d.update(1.0) is None  # the spike did not join the window
    assert d.update(float("nan")).metric == "loss"


def test_median_mad_ignores_an_outlier_in_the_window_that_inflates_sigma():
    history = [1.0] * 19 + [50.0] + [1.0 + 0.001 * i for i in range(10)]
    mean_std = SpikeDetector("g", warmup=5, method="mean_std", k=3)
    mad = SpikeDetector("g", warmup=5, method="median_mad", k=3)
    for d in (mean_std, mad):
        d.values.extend(history)
    assert mean_std.update(5.0) is None  # sigma inflated by the 50: a 5x jump hides
    assert mad.update(5.0) is not None  # the robust baseline still sees it
