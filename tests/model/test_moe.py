"""The MoE block (model/moe.py) against plain reference code: routing, the experts' batched
matmuls, the combine, the load-balancing and z-losses and their gradients, capacity drops."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

from bigtrain.config.model import MoEConfig, moe_blocks
from bigtrain.config.schema import ModelConfig
from bigtrain.errors import ConfigError
from bigtrain.model.gpt import GPT, make_moe
from bigtrain.model.moe import (
    aux_grad_scale,
    dispatch_order,
    grouped_mm,
    moe_layers,
    per_expert_mm,
    route,
    uses_grouped_kernel,
)

pytestmark = pytest.mark.unit


def model_cfg(**moe) -> ModelConfig:
    return ModelConfig(
        vocab_size=64,
        n_layers=3,
        n_heads=2,
        d_model=16,
        seq_len=8,
        mlp="swiglu",
        bias=False,
        norm="rmsnorm",
        position="rope",
        moe=MoEConfig(**{"experts": 4, "top_k": 2, **moe}),
    )


def layer(**moe) -> torch.nn.Module:
    torch.manual_seed(0)
    m = make_moe(model_cfg(**moe))
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return m.double()  # FP64: the comparisons below are exact up to summation order


def reference(m, x: torch.Tensor, capacity: int | None = None) -> torch.Tensor:
    """Token by token: FP32 router, softmax, top-k, renormalised weights, each chosen expert's
    SwiGLU MLP; with a capacity, an expert serves its first `capacity` pairs in token order."""
    flat = x.reshape(-1, x.shape[-1])
    out = torch.zeros_like(flat)
    taken = [0] * m.cfg.experts
    e = m.experts
    for t in range(flat.shape[0]):
        probs = (flat[t] @ m.router.weight.t()).softmax(-1)
        w, idx = probs.topk(m.cfg.top_k)
        w = w / w.sum()
        for weight, i in zip(w, idx.tolist(), strict=True):
            taken[i] += 1
            if capacity is not None and taken[i] > capacity:
                continue
            h = F.silu(flat[t] @ e.w_gate[i]) * (flat[t] @ e.w_up[i])
            out[t] = out[t] + weight * (h @ e.w_down[i])
    if m.shared is not None:
        out = out + m.shared(flat)
    return out.view(x.shape)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bench/gpu.sh runs it)")
def test_on_cuda_the_grouped_kernel_equals_one_matmul_per_expert_in_bf16():
    device = torch.device("cuda")
    counts = torch.tensor([300, 0, 17, 707], device=device)
    x = torch.randn(1024, 256, device=device, requires_grad=True)
    w = torch.randn(4, 256, 512, device=device, requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        kernel = uses_grouped_kernel(device, torch.bfloat16, tuple(w.shape))
        y = grouped_mm(x, w, counts)
        y_loop = per_expert_mm(x, w, counts)
    capability = torch.cuda.get_device_capability(device)[0]
    assert kernel == (capability >= 9)
    # BF16 products summed in FP32 by both; the order differs: a few BF16 ulps of the output
    torch.testing.assert_close(y.float(), y_loop.float(), rtol=2e-2, atol=2e-1)
    g = torch.randn_like(y)
    grads = torch.autograd.grad(y, [x, w], g)
    grads_loop = torch.autograd.grad(y_loop, [x, w], g)
    for a, b in zip(grads, grads_loop, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=5e-1)


def test_moe_layer_in_fp32_through_the_grouped_kernel_equals_the_reference():
    m = layer(aux_loss_coef=0.0, z_loss_coef=0.0).float()
    x = torch.randn(2, 8, 16)
    assert uses_grouped_kernel(x.device, torch.float32, tuple(m.experts.w_up.shape))
    ref = layer(aux_loss_coef=0.0, z_loss_coef=0.0).float()
    torch.testing.assert_close(m(x), reference(ref, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shared", [0, 1])
def test_moe_layer_equals_token_by_token_reference_outputs_and_gradients(shared):
    m = layer(shared_experts=shared, aux_loss_coef=0.0, z_loss_coef=0.0)
    x = torch.randn(2, 8, 16, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    with aux_grad_scale(m, 1.0):  # zero coefficients: the losses' gradient adds nothing
        y = m(x)
        grads = torch.autograd.grad(y.square().sum(), [x, *m.parameters()])
    ref = layer(shared_experts=shared, aux_loss_coef=0.0, z_loss_coef=0.0)
    y_ref = reference(ref, x_ref)
    grads_ref = torch.autograd.grad(y_ref.square().sum(), [x_ref, *ref.parameters()])
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-12)


def test_capacity_drops_the_pairs_beyond_each_experts_capacity_and_counts_them():
    m = layer(capacity_factor=0.5, aux_loss_coef=0.0, z_loss_coef=0.0)
    x = torch.randn(1, 8, 16, dtype=torch.float64)
    capacity = m.capacity(8)
    assert capacity == math.ceil(0.5 * 8 * 2 / 4) == 2
    y = m(x)
    torch.testing.assert_close(
        y, reference(layer(capacity_factor=0.5), x, capacity), rtol=1e-5, atol=1e-5
    )
    load = m.stats[:4]
    dropped = m.stats[4 + 2].item()
    assert load.sum().item() == 16  # every pair counted as routed, before the drop
    assert dropped == sum(max(int(n) - capacity, 0) for n in load.tolist()) > 0
    dropless = layer(aux_loss_coef=0.0, z_loss_coef=0.0)
    dropless(x)
    assert dropless.stats[4 + 2].item() == 0


def test_dispatch_order_groups_pairs_by_expert_in_token_order():
    experts = torch.tensor([[2, 0], [0, 1], [2, 1], [0, 2]])
    order, counts = dispatch_order(experts, 4, None)
    flat = experts.flatten()
    assert flat[order].tolist() == [0, 0, 0, 1, 1, 2, 2, 2]
    assert order.tolist() == [1, 2, 6, 3, 5, 0, 4, 7]
    assert counts.tolist() == [3, 2, 3, 0]
    kept, capped = dispatch_order(experts, 4, 2)
    assert kept.tolist() == [1, 2, 3, 5, 0, 4]  # each expert's first two pairs by token
    assert capped.tolist() == [2, 2, 2, 0]


def test_load_balancing_and_z_loss_values_and_gradients():
    logits = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    r = route(logits, 2, "softmax", True)
    probs = logits.softmax(-1)
    share = torch.zeros(4, dtype=torch.float64)
    for i in r.experts.flatten().tolist():
        share[i] += 1 / 12
    aux = 4 * (share * probs.mean(0)).sum()
    z = (torch.logsumexp(logits, -1) ** 2).mean()
    torch.testing.assert_close(r.aux, aux)
    torch.testing.assert_close(r.z, z)
    g_aux, g_z = torch.autograd.grad(r.aux, logits)[0], torch.autograd.grad(r.z, logits)[0]
    torch.testing.assert_close(g_aux, torch.autograd.grad(aux, logits)[0])
    torch.testing.assert_close(g_z, torch.autograd.grad(z, logits)[0])
    # Uniform probabilities and a perfectly balanced load: the loss is exactly 1.
    flat = route(torch.zeros(4, 4), 1, "softmax", True)
    assert flat.aux.item() == pytest.approx(1.0)


def test_aux_losses_reach_the_router_as_terms_of_the_loss_scaled_like_it():
    """AttachAux: the router's gradient of y.sum() with the losses attached equals that of
    y.sum() + aux_coef * aux + z_coef * z computed by hand, also under a scale (the loss scale
    over micro-batches)."""
    m = layer(aux_loss_coef=0.3, z_loss_coef=0.2)
    x = torch.randn(2, 8, 16, dtype=torch.float64)
    with aux_grad_scale(m, 4.0):
        (4.0 * m(x).sum()).backward()
    attached = m.router.weight.grad.clone()
    ref = layer(aux_loss_coef=0.0, z_loss_coef=0.0)
    with aux_grad_scale(ref, 4.0):  # zero coefficients: the attached losses add nothing
        y = ref(x)
        logits = x.reshape(-1, 16) @ ref.router.weight.t()
        r = route(logits, 2, "softmax", True)
        (4.0 * (y.sum() + 0.3 * r.aux + 0.2 * r.z)).backward()
    torch.testing.assert_close(attached, ref.router.weight.grad, rtol=1e-5, atol=1e-6)


def test_a_backward_without_the_steps_aux_grad_scale_raises_naming_it():
    """The losses' gradient is the step's loss factor, given to the forward: a backend that
    forgets it, or gives it around the backward only, would train the routers with a wrong
    gradient. The backward raises instead, and the factor lasts only while it is given."""
    model = GPT(model_cfg())
    idx = torch.randint(0, 64, (2, 8))
    with pytest.raises(RuntimeError, match=r"no aux_grad_scale .*aux_grad_scale\(model, factor\)"):
        model(idx).sum().backward()
    logits = model(idx)
    with aux_grad_scale(model, 1.0), pytest.raises(RuntimeError, match="no aux_grad_scale"):
        logits.sum().backward()
    with aux_grad_scale(model, 0.5):
        assert [m.aux_grad_scale for m in moe_layers(model)] == [0.5, 0.5, 0.5]
        model(idx).sum().backward()
    assert [m.aux_grad_scale for m in moe_layers(model)] == [None, None, None]
    assert all(p.grad is not None for p in model.parameters())


def test_two_forwards_record_the_importance_extremes_and_the_score_spread():
    """What router_spread reads: per expert the largest mean softmax score of a forward, 1 - the
    smallest, and the sum over forwards of the score's standard deviation over tokens."""
    m = layer()
    xs = [torch.randn(2, 8, 16, dtype=torch.float64) for _ in range(2)]
    for x in xs:
        m(x)
    probs = [(x.reshape(-1, 16) @ m.router.weight.t()).softmax(-1) for x in xs]
    means = torch.stack([p.mean(0) for p in probs])
    expected = torch.cat([means.max(0).values, 1 - means.min(0).values])
    torch.testing.assert_close(m.extremes, expected)
    std = sum(p.std(0, correction=0) for p in probs)
    torch.testing.assert_close(m.stats[4 + 4 :], std.to(m.stats.dtype))
    assert m.stats[4 + 3].item() == 2


def test_sigmoid_scores_without_renormalisation():
    logits = torch.tensor([[0.0, 2.0, -1.0, 1.0]])
    r = route(logits, 2, "sigmoid", False)
    assert r.experts.tolist() == [[1, 3]]
    torch.testing.assert_close(r.weights, torch.sigmoid(torch.tensor([[2.0, 1.0]])))


def test_grouped_kernel_equals_one_matmul_per_expert_values_and_gradients():
    """torch._grouped_mm (CPUs in FP32/BF16, CUDA from sm90 in BF16) against the per-expert
    loop (the fallback everywhere else), with an expert that gets no row."""
    counts = torch.tensor([3, 0, 7])
    x = torch.randn(10, 8, requires_grad=True)
    w = torch.randn(3, 8, 4, requires_grad=True)
    x2, w2 = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    assert uses_grouped_kernel(x.device, torch.float32, tuple(w.shape))
    y, y_loop = grouped_mm(x, w, counts), per_expert_mm(x2, w2, counts)
    torch.testing.assert_close(y, y_loop)
    g = torch.randn_like(y)
    torch.testing.assert_close(
        torch.autograd.grad(y, [x, w], g), torch.autograd.grad(y_loop, [x2, w2], g)
    )
    cpu = torch.device("cpu")
    assert uses_grouped_kernel(cpu, torch.bfloat16, (3, 8, 16))
    assert not uses_grouped_kernel(cpu, torch.bfloat16, (3, 8, 4))  # 8-byte rows: the loop
    assert not uses_grouped_kernel(cpu, torch.float64, (3, 8, 4))
    meta_cuda = torch.device("cuda")
    if not torch.cuda.is_available():  # the CUDA rule without a GPU: BF16 only
        assert not uses_grouped_kernel(meta_cuda, torch.float32, (3, 8, 16))


def test_gpt_places_moe_blocks_from_first_every_nth_and_counts_stats_in_training_only():
    cfg = model_cfg(first=1, every=1)
    assert moe_blocks(cfg) == [1, 2]
    assert moe_blocks(model_cfg(first=0, every=2)) == [0, 2]
    model = GPT(cfg)
    assert model.blocks[0].moe is None and model.blocks[0].mlp is not None
    assert [b.moe is not None for b in model.blocks] == [False, True, True]
    assert len(moe_layers(model)) == 2
    idx = torch.randint(0, 64, (2, 8))
    model.eval()
    with torch.no_grad():
        model(idx)
    assert all(m.stats.sum().item() == 0 for m in moe_layers(model))
    model.train()
    with aux_grad_scale(model, 1.0):
        model(idx).sum().backward()
    for m in moe_layers(model):
        assert m.stats[:4].sum().item() == 2 * 8 * 2  # pairs
        assert m.stats[4 + 3].item() == 1  # one forward


def test_activation_checkpointing_recompute_is_not_counted_twice():
    from bigtrain.parallel.transforms import apply_activation_checkpointing

    model = GPT(model_cfg())
    apply_activation_checkpointing(model, "full")
    with aux_grad_scale(model, 1.0):
        model(torch.randint(0, 64, (2, 8))).sum().backward()
    assert [m.stats[4 + 3].item() for m in moe_layers(model)] == [1, 1, 1]  # one forward each


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("top_k", 5, "between 1 and model.moe.experts (4)"),
        ("top_k", 0, "between 1"),
        ("first", 2, "below model.n_layers (2)"),
        ("every", 0, "at least 1"),
        ("score", "relu", "softmax or sigmoid"),
        ("capacity_factor", -1.0, ">= 0"),
        ("aux_loss_coef", -0.1, ">= 0"),
    ],
)
def test_impossible_moe_settings_name_their_key(micro, key, value, expected):
    with pytest.raises(ConfigError, match=rf"model\.moe\.{key}.*{re.escape(expected)}"):
        micro("model.moe.experts=4", f"model.moe.{key}={value}")


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["model.moe.experts=4", "parallel.expert_parallel=2"],
            "'parallel.expert_parallel' (2) needs parallel.backend=fsdp, got parallel.backend=local",
        ),
        (
            ["model.moe.experts=6", "parallel.backend=fsdp", "parallel.expert_parallel=4"],
            "'parallel.expert_parallel' (4) must divide model.moe.experts (6)",
        ),
        (
            ["parallel.backend=fsdp", "parallel.expert_parallel=2"],
            "'parallel.expert_parallel' (2) needs an MoE model (model.moe.experts > 0)",
        ),
        (
            ["model.moe.experts=4", "parallel.backend=fsdp", "parallel.tensor_parallel=2"],
            "'parallel.tensor_parallel' (2): MoE blocks (model.moe.experts > 0) are not split",
        ),
    ],
)
def test_impossible_expert_parallel_settings_name_their_key(micro, overrides, expected):
    with pytest.raises(ConfigError, match=re.escape(expected)):
        micro(*overrides)
