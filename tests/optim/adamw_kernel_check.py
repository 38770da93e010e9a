"""Runs LowPrecisionAdamW's Triton kernel in the CPU interpreter beside the torch implementation
and prints how far apart they end, as JSON.

Run as `TRITON_INTERPRET=1 python -m tests.optim.adamw_kernel_check`: the interpreter is chosen
when the kernel is defined, so it needs a process of its own (test_adamw.py does that)."""

import json

import torch

from bigtrain.optim import adamw_kernel
from bigtrain.optim.adamw import LowPrecisionAdamW
from bigtrain.utils.triton import triton_available as available

SIZES = (3000, 17, 1, 2500)  # several chunks, partial blocks, a scalar


def train(dtype, fused, rounding="nearest", steps=4):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in SIZES]
    opt = LowPrecisionAdamW(
        params, lr=1e-2, weight_decay=0.1, state_dtype=dtype, rounding=rounding, fused=fused
    )
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen) * 1e-3
        opt.step()
    return params, opt


def decoded_states(params, opt):
    return [opt._decode(opt.state[p], k) for p in params for k in ("exp_avg", "exp_avg_sq")]


def relative(a, b):
    a, b = (
        torch.cat([x.detach().float().flatten() for x in a]),
        torch.cat([x.detach().float().flatten() for x in b]),
    )
    return ((a - b).abs().max() / b.abs().max()).item()


if __name__ == "__main__":
    assert available(torch.device("cpu")), "run with TRITON_INTERPRET=1"
    # Few programs: the interpreter costs about 2 ms per program instance.
    adamw_kernel.CHUNK, adamw_kernel.BLOCK = 4096, 4096
    out = {}
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        (pk, ok), (pt, ot) = train(dtype, True), train(dtype, False)
        out[str(dtype).split(".")[1]] = {
            "param_rel": relative(pk, pt),
            "state_rel": relative(decoded_states(pk, ok), decoded_states(pt, ot)),
        }
        if dtype == torch.float16:
            out["float16"]["scales_equal"] = all(
                torch.equal(ok.state[a][k], ot.state[b][k])
                for a, b in zip(pk, pt, strict=True)
                for k in ("exp_avg_scale", "exp_avg_sq_scale")
            )
    # Stochastic rounding: the first moment of a constant gradient after one step is exactly
    # (1 - beta1) * g; averaged over many positions the rounded values keep that mean.
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.zeros(20000))
    opt = LowPrecisionAdamW([p], lr=0.0, betas=(0.9, 0.999), state_dtype=torch.bfloat16, fused=True)
    g = torch.tensor(0.3)
    p.grad = torch.full_like(p, g.item())
    opt.step()
    m = opt.state[p]["exp_avg"].float()
    exact = (1 - torch.tensor(0.9)) * g  # in FP32, as the kernel computes it; not a BF16 value
    out["bf16_stochastic"] = {
        "mean_error": abs(m.mean().item() - exact.item()),
        "differs_from_nearest": bool((m != exact.to(torch.bfloat16).float()).any()),
    }
    print(json.dumps(out))
