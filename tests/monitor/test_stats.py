import math

import pytest
import torch

from bigtrain.monitor.slots import Slot, SlotLayout
from bigtrain.monitor.stats import (
    LOSS,
    MAX_ABS,
    grad_slots,
    layer_of,
    layer_stats,
    local_grad_stats,
    packed_stats,
    ranked,
    reduce_grad_stats,
    scale_stats,
    stats_values,
)
from tests.conftest import run_in_triton_interpreter
from tests.distributed import run_distributed
from tests.monitor.grads import DTYPES, many_chunk_grads, poisoned_grads, reference


def check_against_reference(grads, max_abs, sum_sq, nonfinite) -> None:
    for i, g in enumerate(grads):
        ref_max, ref_sq, ref_bad = reference(g)
        assert nonfinite[i] == ref_bad, f"tensor {i}: non-finite count"
        assert max_abs[i] == pytest.approx(ref_max, rel=1e-6), f"tensor {i}: max |g|"
        if ref_bad:
            assert not math.isfinite(sum_sq[i]), f"tensor {i}: a NaN/Inf shows in the sum"
        else:
            assert sum_sq[i] == pytest.approx(ref_sq, rel=1e-5), f"tensor {i}: sum of squares"


@pytest.mark.unit
@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_fallback_against_a_float64_reference(dtype):
    grads = poisoned_grads(dtype)
    stats = local_grad_stats(
        [(f"t{i}", g) for i, g in enumerate(grads)], torch.device("cpu"), use_kernel=False
    )
    assert stats.sum_sq.dtype == stats.max_abs.dtype == stats.nonfinite.dtype == torch.float32
    check_against_reference(
        grads, stats.max_abs.tolist(), stats.sum_sq.tolist(), stats.nonfinite.tolist()
    )


@pytest.mark.unit
def test_cheap_steps_skip_max_abs_but_count_nonfinite_values():
    grads = poisoned_grads(torch.float32)
    named = [(f"t{i}", g) for i, g in enumerate(grads)]
    cheap = local_grad_stats(named, torch.device("cpu"), full=False, use_kernel=False)
    full = local_grad_stats(named, torch.device("cpu"), full=True, use_kernel=False)
    assert cheap.max_abs is None
    assert cheap.nonfinite.tolist() == full.nonfinite.tolist() == [0, 0, 0, 1, 1, 0, 0, 2]
    assert torch.equal(cheap.sum_sq.isfinite(), full.sum_sq.isfinite())


@pytest.mark.e2e
def test_triton_kernel_in_the_interpreter_against_the_same_reference():
    out = run_in_triton_interpreter("tests.monitor.kernel_check")
    for dtype in DTYPES:
        check_against_reference(poisoned_grads(dtype), *out[str(dtype)])
    max_abs, sum_sq, nonfinite = out["mixed"]
    assert nonfinite == [0, 0, 0] and len(max_abs) == 3 and all(s > 0 for s in sum_sq)
    for scale in (1.0, 3.0):  # a two-iteration fold; one kernel object, two address tables
        check_against_reference(many_chunk_grads(scale), *out[f"many_chunks_{scale}"])


def shard_stats(rank_of_nan: int) -> tuple[list, list, list, float]:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    full = [torch.randn(100), torch.randn(40, 3), torch.randn(3)]
    full[1][5, 2] = float("nan")  # in the first half: rank 0's shard
    named = [(f"t{i}", t.flatten().chunk(2)[rank]) for i, t in enumerate(full[:2])]
    named.append(("t2", full[2] if rank == 1 else torch.empty(0)))  # held by rank 1 only
    stop = Slot("stop", 1, "sum")
    routers = Slot("router_extremes", 3, "max")
    layout = SlotLayout([*grad_slots(3, full=True), stop, routers])
    local = local_grad_stats(named, torch.device("cpu"), use_kernel=False)
    values = stats_values(local) | {
        LOSS: torch.tensor(float(rank + 1)),
        "stop": torch.tensor([float(rank == 1)]),  # a preemption request on rank 1 only
        "router_extremes": torch.tensor([float(rank), 1.0 - rank, 0.5]),
    }
    pack = reduce_grad_stats(layout.fill(values), loss_ranks=2)
    stats = packed_stats(local.names, pack)
    # A step without max |g|: the router extremes alone take the MAX all-reduce.
    cheap = SlotLayout([*grad_slots(3, full=False), stop, Slot("router_extremes", 1, "max")])
    local = local_grad_stats(named, torch.device("cpu"), full=False, use_kernel=False)
    values = stats_values(local) | {
        LOSS: torch.tensor(1.0),
        "stop": torch.tensor([0.0]),
        "router_extremes": torch.tensor([0.25 * rank]),
    }
    partial = reduce_grad_stats(cheap.fill(values), loss_ranks=2)
    assert MAX_ABS not in partial and partial["router_extremes"].tolist() == [0.25]
    assert pack["router_extremes"].tolist() == [1.0, 1.0, 0.5]
    dist.destroy_process_group()
    return (
        stats.max_abs.tolist(),
        stats.sum_sq.tolist(),
        stats.nonfinite.tolist(),
        pack[LOSS].item(),
        pack["stop"].tolist(),
    )


@pytest.mark.distributed
def test_sharded_stats_reduce_to_the_full_tensors_on_every_rank():
    r0, r1 = run_distributed(shard_stats, 2, 0)
    assert r0[0] == r1[0] and r0[2] == r1[2] and r0[3] == r1[3]
    torch.manual_seed(0)
    full = [torch.randn(100), torch.randn(40, 3), torch.randn(3)]
    assert r0[0][0] == pytest.approx(full[0].abs().max().item())
    assert r0[1][0] == pytest.approx((full[0].double() ** 2).sum().item(), rel=1e-5)
    assert r0[1][2] == pytest.approx((full[2].double() ** 2).sum().item(), rel=1e-5)
    assert r0[2] == [0.0, 1.0, 0.0]  # the NaN in rank 0's half of t1 is seen by both ranks
    assert r0[0][1] == float("inf")
    assert r0[3] == 1.5  # mean of the ranks' losses 1 and 2
    assert r0[4] == r1[4] == [1.0]  # both ranks know that one rank raised the flag


@pytest.mark.unit
def test_scaled_stats_divide_by_the_loss_scale_exactly():
    g = torch.randn(1000)
    named = [("w", g * 1024.0)]
    stats = scale_stats(local_grad_stats(named, torch.device("cpu"), use_kernel=False), 1024.0)
    ref = local_grad_stats([("w", g)], torch.device("cpu"), use_kernel=False)
    assert stats.max_abs.item() == ref.max_abs.item()
    assert stats.sum_sq.item() == pytest.approx(ref.sum_sq.item(), rel=1e-6)


@pytest.mark.unit
def test_layers_group_tensors_in_model_order():
    names = ["tok_emb.weight", "blocks.0.attn.qkv.weight", "blocks.0.mlp.fc.weight", "blocks.1.x"]
    assert [layer_of(n) for n in names] == ["tok_emb", "blocks.0", "blocks.0", "blocks.1"]
    assert layer_of("model.layers.12.self_attn.q_proj.weight") == "model.layers.12"
    norms, maxes = layer_stats(names, [4.0, 9.0, 16.0, 1.0], [1.0, 2.0, 5.0, 0.5])
    assert list(norms) == ["tok_emb", "blocks.0", "blocks.1"]
    assert norms["blocks.0"] == 5.0 and maxes["blocks.0"] == 5.0 and norms["tok_emb"] == 2.0


@pytest.mark.unit
def test_ranked_puts_nan_first_and_leaves_zeros_out():
    top = ranked(["a", "b", "c", "d"], [1.0, float("nan"), 0.0, 3.0], 4)
    assert [name for name, _ in top] == ["b", "d", "a"]
    assert math.isnan(top[0][1]) and top[1][1] == 3.0


@pytest.mark.unit
@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU; the kernel's logic is tested in Triton's CPU interpreter above",
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_kernel_on_cuda_against_the_reference(dtype):
    grads = [g.cuda() for g in poisoned_grads(dtype)]
    stats = local_grad_stats([(f"t{i}", g) for i, g in enumerate(grads)], torch.device("cuda"))
    check_against_reference(
        [g.cpu() for g in grads],
        stats.max_abs.tolist(),
        stats.sum_sq.tolist(),
        stats.nonfinite.tolist(),
    )


@pytest.mark.unit
@pytest.mark.parametrize("threads", [1, 2])
def test_tensors_above_one_slice_of_the_cpu_path_against_the_reference(threads):
    """Tensors above ATen's grain size (32768 values, where a CPU reduction splits over threads),
    with 1 and 2 threads: a NaN in a later part, an all-negative tensor whose largest |g| is a
    minimum, the largest value in the second half."""
    g = torch.Generator().manual_seed(1)
    grads = [
        torch.randn(70_001, generator=g),
        -torch.rand(40_000, generator=g) - 0.5,
        torch.randn(2, 32_768, generator=g),
        torch.randn(33, generator=g),
    ]
    grads[0][50_000] = float("nan")
    grads[2][1, 7] = 40.0  # the largest value lies in the second slice
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        stats = local_grad_stats(
            [(f"t{i}", t) for i, t in enumerate(grads)], torch.device("cpu"), use_kernel=False
        )
    finally:
        torch.set_num_threads(before)
    check_against_reference(
        grads, stats.max_abs.tolist(), stats.sum_sq.tolist(), stats.nonfinite.tolist()
    )
    assert stats.max_abs[2].item() == 40.0 and stats.nonfinite.tolist() == [1, 0, 0, 0]
