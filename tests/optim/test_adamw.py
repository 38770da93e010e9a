import random
from pathlib import Path

import pytest
import torch

from bigtrain.optim.adamw import LowPrecisionAdamW, bf16_stochastic
from bigtrain.optim.adamw_torch import NoisePool
from bigtrain.utils.syncs import count_host_syncs
from tests.conftest import run_in_triton_interpreter

ROOT = Path(__file__).resolve().parents[2]


def make(state_dtype, seed=0, shape=(64, 64), **kw):
    torch.manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(shape))
    return p, LowPrecisionAdamW(
        [p], lr=1e-3, betas=(0.9, 0.999), weight_decay=0.1, state_dtype=state_dtype, **kw
    )


def run_steps(p, opt, steps, grad_scale=1.0, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        p.grad = torch.randn(p.shape, generator=g) * grad_scale
        opt.step()


@pytest.mark.unit
def test_fp32_states_match_torch_adamw():
    """The update is torch's fused AdamW itself: bit for bit equal to fused, and within 1e-6
    relative of the foreach implementation (whose arithmetic order differs)."""
    p, opt = make(torch.float32)
    q = torch.nn.Parameter(p.detach().clone())
    r = torch.nn.Parameter(p.detach().clone())
    fused = torch.optim.AdamW([q], lr=1e-3, betas=(0.9, 0.999), weight_decay=0.1, fused=True)
    foreach = torch.optim.AdamW([r], lr=1e-3, betas=(0.9, 0.999), weight_decay=0.1, foreach=True)
    for param, optimizer in ((p, opt), (q, fused), (r, foreach)):
        run_steps(param, optimizer, 20)
    assert torch.equal(p, q)
    torch.testing.assert_close(p, r, atol=0, rtol=1e-6)
    assert opt.state[p]["exp_avg"].dtype == torch.float32


@pytest.mark.unit
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


@pytest.mark.unit
def test_fp16_scales_are_powers_of_two_near_2_pow_14():
    p, opt = make(torch.float16)
    run_steps(p, opt, 3, grad_scale=1e-5)
    state = opt.state[p]
    for key in ("exp_avg", "exp_avg_sq"):
        scale = state[key + "_scale"]
        assert scale.dtype == torch.float32 and scale.dim() == 0
        assert torch.log2(scale).item() == int(torch.log2(scale).item())
        peak = state[key].float().abs().max().item()
        assert 2**14 <= peak < 2**15, (key, peak)


@pytest.mark.unit
def test_naive_fp16_copy_of_second_moment_underflows():
    """Why the scaling exists: the FP32 second moment of tiny gradients is zero in plain FP16."""
    p32, o32 = make(torch.float32)
    run_steps(p32, o32, 5, 1e-6)
    assert (o32.state[p32]["exp_avg_sq"].half() == 0).all()


@pytest.mark.unit
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


@pytest.mark.unit
def test_stochastic_rounding_is_unbiased():
    torch.manual_seed(0)
    x = torch.full((200_000,), 1.0 + 2**-10)  # between two BF16 values (1 and 1 + 2^-7)
    assert bf16_stochastic(x).float().mean().item() == pytest.approx(1.0 + 2**-10, abs=2e-4)
    assert x.to(torch.bfloat16).float().mean().item() == 1.0  # nearest always rounds it away


@pytest.mark.unit
def test_noise_pool_is_uniform_and_unbiased_per_position():
    pool = NoisePool()
    values = pool._pool(torch.device("cpu"))[: NoisePool.SIZE]
    assert torch.equal(torch.bincount(values, minlength=1 << 16), torch.full((1 << 16,), 16))
    # One position rounded over many steps: its mean is the FP32 value (for a uniform offset
    # each position sees every noise value equally often).
    random.seed(0)
    x = torch.full((3,), 1.0 + 2**-10)
    means = torch.zeros(3)
    for _ in range(4000):
        bits = x.clone().view(torch.int32)
        pool.add_to(bits)
        means += (bits & -65536).view(torch.float32) / 4000
    torch.testing.assert_close(means, x, atol=3e-4, rtol=0)
    assert len({tuple(pool._pool(torch.device("cpu"))[:8].tolist()) for _ in range(2)}) == 1


@pytest.mark.unit
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
    rng = torch.get_rng_state(), random.getstate()
    run_steps(p, opt, 3, seed=7)
    torch.set_rng_state(rng[0])
    random.setstate(rng[1])
    run_steps(q, other, 3, seed=7)
    assert torch.equal(p, q)  # bit-exact continuation


@pytest.mark.unit
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


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_step_reads_nothing_back_from_the_device(dtype):
    params = [torch.nn.Parameter(torch.randn(n)) for n in (300, 7, 1000)]
    opt = LowPrecisionAdamW(params, lr=1e-3, weight_decay=0.1, state_dtype=dtype)
    for p in params:
        p.grad = torch.randn_like(p)
    assert count_host_syncs(opt.step) == 0  # the first step creates the states
    assert count_host_syncs(opt.step) == 0
    assert count_host_syncs(lambda: params[0].sum().item()) == 1  # the counter counts


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_state_tensor_follows_the_parameters_device(dtype):
    """On the meta device a tensor created elsewhere (a CPU step counter, say) would fail or show:
    the CPU-side guard for the GPU path."""
    params = [torch.nn.Parameter(torch.empty(n, device="meta")) for n in (300, 7)]
    opt = LowPrecisionAdamW(params, state_dtype=dtype, fused=False)
    for p in params:
        p.grad = torch.empty_like(p)
    opt.step()
    for p in params:
        for key, value in opt.state[p].items():
            assert value.device.type == "meta", key


@pytest.mark.unit
def test_chunks_give_the_same_update_as_one_pass():
    from bigtrain.optim import adamw_torch

    results = []
    for chunk in (adamw_torch.CHUNK_NUMEL, 500):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(n)) for n in (300, 7, 1000, 450)]
        opt = LowPrecisionAdamW(params, lr=1e-2, state_dtype=torch.float16)
        old, adamw_torch.CHUNK_NUMEL = adamw_torch.CHUNK_NUMEL, chunk
        try:
            for step in range(3):
                for i, p in enumerate(params):
                    p.grad = torch.full_like(p, 0.01 * (i + 1) * (step + 1))
                opt.step()
        finally:
            adamw_torch.CHUNK_NUMEL = old
        results.append(torch.cat([p.detach() for p in params]))
    assert torch.equal(results[0], results[1])


@pytest.mark.unit
def test_chunk_ranges():
    from bigtrain.optim.adamw_torch import _chunks

    assert _chunks([5, 5, 5], 10) == [(0, 2), (2, 3)]
    assert _chunks([20, 5, 5], 10) == [(0, 1), (1, 3)]  # a large tensor is a chunk of its own
    assert _chunks([], 10) == [(0, 0)]


@pytest.mark.e2e
def test_triton_kernel_in_the_interpreter_matches_the_torch_implementation():
    """The CUDA kernel's logic, run by Triton's CPU interpreter in a process of its own, against
    the torch implementation on the same tensors: FP32, FP16 (and its scales) and BF16 with
    round-to-nearest agree to rounding; BF16 with stochastic rounding stays unbiased."""
    pytest.importorskip("triton")
    result = run_in_triton_interpreter("tests.optim.adamw_kernel_check")
    for dtype in ("float32", "float16", "bfloat16"):
        assert result[dtype]["param_rel"] < 1e-6, (dtype, result[dtype])
        assert result[dtype]["state_rel"] < 1e-6, (dtype, result[dtype])
    assert result["float16"]["scales_equal"]
    # m = 0.03 lies between BF16 values 1.2e-4 apart: 20000 stochastic roundings average to it.
    assert result["bf16_stochastic"]["mean_error"] < 5e-6, result["bf16_stochastic"]
    assert result["bf16_stochastic"]["differs_from_nearest"]


@pytest.mark.unit
def test_fused_low_precision_states_need_triton_on_cuda():
    from bigtrain.config import load_config
    from bigtrain.errors import ConfigError
    from bigtrain.optim.optimizer import make_adamw
    from bigtrain.precision.policy import detect_hardware, resolve_policy

    cpu = torch.device("cpu")
    params = [{"params": [torch.nn.Parameter(torch.zeros(4))]}]
    for fused, expected in (("null", False), ("false", False), ("true", None)):
        cfg = load_config([], [f"optim.fused={fused}", "precision.optimizer_state_dtype=fp16"])
        policy = resolve_policy(cfg.precision, detect_hardware(cpu), 10**6)
        if expected is None:
            with pytest.raises(ConfigError, match=r"optim\.fused.*Triton kernel"):
                make_adamw(params, cfg.optim, policy, cpu)
            continue
        opt = make_adamw(params, cfg.optim, policy, cpu)
        assert isinstance(opt, LowPrecisionAdamW) and opt.uses_kernel(cpu) is expected
