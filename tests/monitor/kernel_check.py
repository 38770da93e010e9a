"""Runs the Triton kernel in the CPU interpreter and prints its results as JSON.

Run as `TRITON_INTERPRET=1 python -m tests.monitor.kernel_check`: the interpreter is chosen when
the kernel is defined, so it needs a process of its own (tests/monitor/test_stats.py does that)."""

import json

import torch

from bigtrain.monitor import kernel
from bigtrain.utils.triton import triton_available
from tests.monitor.grads import DTYPES, many_chunk_grads, poisoned_grads

if __name__ == "__main__":
    assert triton_available(torch.device("cpu")), "run with TRITON_INTERPRET=1"
    out = {}
    for dtype in DTYPES:
        grads = poisoned_grads(dtype)
        # Large blocks: the interpreter costs about 2 ms per program instance.
        max_abs, sum_sq, nonfinite = kernel.triton_grad_stats(
            grads, torch.device("cpu"), chunk=16384, block=8192
        )
        out[str(dtype)] = [max_abs.tolist(), sum_sq.tolist(), nonfinite.tolist()]
    mixed = [torch.randn(5000), torch.randn(300).bfloat16(), torch.randn(40).half()]
    max_abs, sum_sq, nonfinite = kernel.triton_grad_stats(
        mixed, torch.device("cpu"), chunk=8192, block=8192
    )
    out["mixed"] = [max_abs.tolist(), sum_sq.tolist(), nonfinite.tolist()]
    # More chunk partials than one fold iteration takes (1100 > FOLD_BLOCK), through one kernel
    # object called twice: the second call's tensors live elsewhere (its address table changes).
    stats = kernel.GradStatsKernel(chunk=256, block=256)
    for scale in (1.0, 3.0):
        max_abs, sum_sq, nonfinite = stats(many_chunk_grads(scale), torch.device("cpu"))
        out[f"many_chunks_{scale}"] = [max_abs.tolist(), sum_sq.tolist(), nonfinite.tolist()]
    print(json.dumps(out))
