import pytest
import torch

from bigtrain.precision.adamw import LowPrecisionAdamW, bf16_stochastic


def make(state_dtype, seed=0, **kw):
    torch.manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(64, 64))
    return p, LowPrecisionAdamW(
        [p], lr=1e-3, betas=(0.9, 0.999), weight_decay=0.1, state_dtype=state_dtype, **kw
    )


def run_steps(p, opt, steps, grad_scale=1.0, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        p.grad = torch.randn(p.shape, generator=g) * grad_scale
        opt.step()


def test_fp32_states_match_torch_adamw():
    p, opt = make(torch.float32)
    q = torch.nn.Parameter(p.detach().clone())
    ref = torch.optim.AdamW([q], lr=1e-3, betas=(0.9, 0.999), weight_decay=0.1)
    run_steps(p, opt, 20)
    run_steps(q, ref, 20)
    torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "grad_scale", [1.0, 1e-6]
)  # 1e-6: g^2 ~ 1e-12 underflows a naive FP16 copy
def test_low_precision_states_track_fp32(dtype, grad_scale):
    p32, o32 = make(torch.float32)
    plo, olo = make(dtype)
    run_steps(p32, o32, 50, grad_scale)
    run_steps(plo, olo, 50, grad_scale)
    # each step moves a weight by at most lr; the states' rounding perturbs the update by a few %
    drift = (plo - p32).abs().max().item()
    assert drift < 50 * 1e-3 * 0.05, drift
    state = olo.state[plo]
    assert state["exp_avg"].dtype == dtype and state["exp_avg_sq"].dtype == dtype
    v_ref = o32.state[p32]["exp_avg_sq"]
    v = olo._decode(state, "exp_avg_sq")
    assert (v > 0).all()  # nothing underflowed to zero
    torch.testing.assert_close(v, v_ref, rtol=0.1, atol=0)


def test_naive_fp16_copy_of_second_moment_underflows():
    """Why the scaling exists: the FP32 second moment of tiny gradients is zero in plain FP16."""
    p32, o32 = make(torch.float32)
    run_steps(p32, o32, 5, 1e-6)
    assert (o32.state[p32]["exp_avg_sq"].half() == 0).all()


def test_bf16_round_to_nearest_stalls_where_stochastic_rounding_does_not():
    """An EMA of a constant gradient 1 with beta=0.999 approaches 1; in BF16 its increments of
    0.001 * (1 - m) fall below half an ulp near 0.5 and round-to-nearest stops there."""
    results = {}
    for rounding in ("nearest", "stochastic"):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.zeros(4096))
        opt = LowPrecisionAdamW(
            [p], lr=0.0, betas=(0.999, 0.999), state_dtype=torch.bfloat16, rounding=rounding
        )
        for _ in range(3000):
            p.grad = torch.ones(4096)
            opt.step()
        results[rounding] = opt._decode(opt.state[p], "exp_avg").mean().item()
    expected = 1 - 0.999**3000  # 0.95
    assert results["nearest"] < 0.7
    assert results["stochastic"] == pytest.approx(expected, abs=0.02)


def test_stochastic_rounding_is_unbiased():
    torch.manual_seed(0)
    x = torch.full((200_000,), 1.0 + 2**-10)  # between two BF16 values (1 and 1 + 2^-7)
    assert bf16_stochastic(x).float().mean().item() == pytest.approx(1.0 + 2**-10, abs=2e-4)
    assert x.to(torch.bfloat16).float().mean().item() == 1.0  # nearest always rounds it away


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_state_dict_round_trip_is_exact_and_converts_dtypes(dtype):
    p, opt = make(dtype)
    run_steps(p, opt, 5)
    saved = opt.state_dict()
    assert saved["state"][0]["exp_avg"].dtype == torch.float32  # checkpoints hold FP32 moments
    q = torch.nn.Parameter(p.detach().clone())
    other = LowPrecisionAdamW([q], lr=1e-3, betas=(0.9, 0.999), weight_decay=0.1, state_dtype=dtype)
    other.load_state_dict(saved)
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(other.state[q][key], opt.state[p][key])
    rng = torch.get_rng_state()
    run_steps(p, opt, 3, seed=7)
    torch.set_rng_state(rng)
    run_steps(q, other, 3, seed=7)
    assert torch.equal(p, q)  # bit-exact continuation


def test_fp32_torch_checkpoint_loads_into_fp16_states():
    torch.manual_seed(0)
    q = torch.nn.Parameter(torch.randn(64, 64))
    ref = torch.optim.AdamW([q], lr=1e-3, weight_decay=0.1)
    run_steps(q, ref, 5)
    p = torch.nn.Parameter(q.detach().clone())
    opt = LowPrecisionAdamW([p], lr=1e-3, weight_decay=0.1, state_dtype=torch.float16)
    opt.load_state_dict(ref.state_dict())
    assert opt.state[p]["exp_avg"].dtype == torch.float16
    torch.testing.assert_close(
        opt._decode(opt.state[p], "exp_avg"), ref.state[q]["exp_avg"], rtol=2e-3, atol=0
    )
