import math

import numpy as np
import pytest

from bigtrain.monitor.detectors import SpikeDetector

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("method", ["mean_std", "median_mad"])
def test_fires_on_a_10x_spike_after_warmup_not_before(method):
    d = SpikeDetector("loss", window=100, k=3.0, method=method, warmup=20)
    assert d.update(10.0) is None  # during warm-up a 10x value does not fire (and is kept)
    d = SpikeDetector("loss", window=100, k=3.0, method=method, warmup=20)
    for i in range(30):
        assert d.update(1.0 + 0.01 * math.sin(i)) is None
    spike = d.update(10.0)
    assert spike is not None and spike.value == 10.0 and spike.threshold < 1.1
    assert spike.ratio == pytest.approx(10.0, rel=0.02)
    assert len(d.values) == 30  # the spike did not join the window
    assert d.update(1.0) is None
    assert d.update(float("nan")).metric == "loss"


def test_median_mad_sees_a_spike_that_an_outlier_hides_from_mean_std():
    history = [1.0] * 19 + [50.0] + [1.0 + 0.001 * i for i in range(10)]
    mean_std = SpikeDetector("g", warmup=5, method="mean_std", k=3)
    mad = SpikeDetector("g", warmup=5, method="median_mad", k=3)
    for d in (mean_std, mad):
        for v in history:
            d.add(v)
    assert mean_std.check(5.0) == []  # sigma inflated by the 50: a 5x jump hides
    assert [s.metric for s in mad.check(5.0)] == ["g"]  # the robust baseline still sees it


def test_a_vector_detector_names_the_tensor_that_spiked():
    names = ["emb", "w1", "w2"]
    d = SpikeDetector("tensor_max", names, window=50, k=6.0, warmup=10)
    rng = np.random.default_rng(0)
    base = np.array([1e3, 1e-2, 1e-1])  # magnitudes five orders apart, each with its own baseline
    for _ in range(20):
        d.add(base * (1 + 0.05 * rng.standard_normal(3)))
    assert d.check(base) == []
    spikes = d.check(base * np.array([1.0, 10.0, 1.0]))
    assert [s.tensor for s in spikes] == ["w1"] and spikes[0].value == pytest.approx(0.1)
    # Both spike: the larger ratio comes first.
    spikes = d.check(base * np.array([3.0, 1.0, 30.0]))
    assert [s.tensor for s in spikes] == ["w2", "emb"]


def test_state_round_trips_and_a_non_finite_row_is_not_added():
    d = SpikeDetector("x", ["a", "b"], window=3, warmup=1)
    d.add([1.0, 2.0])
    d.add([float("nan"), 2.0])
    d.add([3.0, 4.0])
    e = SpikeDetector("x", ["a", "b"], window=3, warmup=1)
    e.load_state_dict(d.state_dict())
    assert [v.tolist() for v in e.values] == [[1.0, 2.0], [3.0, 4.0]]
    assert e.bounds()[0].tolist() == [2.0, 3.0]


def test_warmup_longer_than_the_window_is_refused():
    with pytest.raises(ValueError, match="warmup"):
        SpikeDetector("x", window=10, warmup=20)


def test_min_factor_keeps_a_heavy_tailed_wiggle_from_firing():
    d = SpikeDetector("grad_norm", window=50, k=3.0, warmup=10, min_factor=5.0)
    for i in range(20):
        d.add(1.0 + 0.05 * math.sin(i))
    assert d.check(2.0) == []  # far beyond 3 sigma, but only 2x the baseline
    assert [s.value for s in d.check(10.0)] == [10.0]


def test_during_warmup_only_a_value_far_above_the_median_is_a_spike():
    from bigtrain.monitor.detectors import SpikeDetector

    d = SpikeDetector("grad_norm", names=["a", "b"], warmup=50, warmup_factor=20, min_factor=5)
    for _ in range(4):
        d.add([1.0, 0.0])
    assert d.check([100.0, 1.0]) == []  # fewer than 5 values: nothing fires yet
    d.add([1.0, 0.0])
    assert d.check([10.0, 1e9]) == []  # 10x is warm-up noise; a column at 0 has no baseline
    (spike,) = d.check([25.0, 1e9])
    assert (spike.tensor, spike.baseline, spike.threshold) == ("a", 1.0, 20.0)


def test_a_tensor_of_rounding_noise_does_not_spike_under_the_relative_floor():
    """Attention's key bias has an exact gradient of zero: its max |g| is noise of ~1e-7 that
    swings 60x. Below 1e-3 of the step's largest max |g| it is ignored; above, it still fires."""
    names = ["emb", "k_bias"]
    base = np.array([3e-2, 2e-7])
    plain = SpikeDetector("tensor_max", names, window=50, k=6.0, warmup=10)
    floored = SpikeDetector("tensor_max", names, window=50, k=6.0, warmup=10, relative_floor=1e-3)
    rng = np.random.default_rng(0)
    for d in (plain, floored):
        for _ in range(20):
            d.add(base * (1 + 0.05 * rng.standard_normal(2)))
    noise = base * np.array([1.0, 60.0])  # 1.2e-5: a 60x swing, 4e-4 of the largest
    assert [s.tensor for s in plain.check(noise)] == ["k_bias"]
    assert floored.check(noise) == []
    real = base * np.array([1.0, 1000.0])  # 2e-4 = 7e-3 of the largest: a spike after all
    assert [s.tensor for s in floored.check(real)] == ["k_bias"]
