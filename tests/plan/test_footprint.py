"""`bigtrain plan` against the ZeRO paper and against the storage the tensors really hold."""

from __future__ import annotations

import pytest
import torch

from bigtrain.build import build_trainer
from bigtrain.config import load_config
from bigtrain.parallel.env import read_env, shutdown
from bigtrain.plan.footprint import COMPONENTS, planned, state_bytes, zero_paper_bytes
from bigtrain.plan.shapes import count_params, meta_model
from bigtrain.precision import Hardware, resolve_policy
from tests.conftest import micro_overrides, run_cli
from tests.distributed import run_distributed

CPU = Hardware("cpu", "test CPU", cpu_bf16=True)


@pytest.mark.unit
@pytest.mark.parametrize(("stage", "gigabytes"), [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_figure(stage, gigabytes):
    """Figure 1 of the ZeRO paper: 7.5B parameters, 64 data-parallel ranks, mixed-precision Adam."""
    states = zero_paper_bytes(stage)
    per_rank = sum(states.per_rank_bytes_per_param(1 if stage == 0 else 64).values()) * 7.5e9
    assert per_rank / 1e9 == pytest.approx(gigabytes, abs=0.05)


@pytest.mark.unit
def test_param_count_matches_the_built_model(micro):
    cfg = micro()
    n, block = count_params(meta_model(cfg.model, cfg.data))
    from bigtrain.model import build_model, num_params

    model = build_model(cfg.model, cfg.data.vocab_size)
    assert n == num_params(model)
    assert block == num_params(model.blocks[0])


def _storage(tensors) -> int:
    seen = {}
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        if t is not None and t.numel():
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def measure(args: list[str]) -> dict:
    """Bytes held by parameters, gradients, FP32 master copies and optimizer states on this rank,
    after one step (so that optimizer states exist) and one more backward (so that grads do)."""
    cfg = load_config([], args)
    trainer = build_trainer(cfg, read_env())
    try:
        backend = trainer.backend
        trainer.train_step()
        for i, (x, y) in enumerate(micro := trainer.loader.next_step()):
            backend.forward_backward(x, y, i, len(micro))
        params = list(backend.model.parameters())
        if backend.name == "zero":
            opt = backend.optimizer
            base = opt.optimizer
            return {
                "compute copies": _storage(params),
                "master weights": _storage(opt.single_partition_of_fp32_groups),
                "optimizer states": _storage(
                    v
                    for s in base.state.values()
                    for v in s.values()
                    if torch.is_tensor(v) and v.numel() > 1
                ),
                "n": trainer.setup.num_params,
            }
        opt = backend.optimizer
        return {
            "master weights": _storage(params),
            "gradients": _storage(p.grad for p in params),
            "optimizer states": _storage(
                v
                for s in opt.state.values()
                for v in s.values()
                if torch.is_tensor(v) and v.numel() > 1
            ),
            "n": trainer.setup.num_params,
        }
    finally:
        trainer.callbacks.close()
        shutdown(clean=False)


@pytest.mark.distributed
@pytest.mark.parametrize(("backend", "world"), [("local", 1), ("fsdp", 2), ("zero", 2)])
def test_plan_matches_measured_storage(tmp_path, corpus_files, cache_dir, backend, world):
    args = micro_overrides(tmp_path / backend, corpus_files, cache_dir) + [
        f"parallel.backend={backend}",
        "parallel.zero_stage=2",
        "precision.compute_dtype=bf16",
        "train.eval_every=0",
        "model.d_model=128",
        "model.n_heads=4",
    ]
    measured = run_distributed(measure, world, args)
    cfg = load_config([], args)
    n, _ = count_params(meta_model(cfg.model, cfg.data))
    states = state_bytes(backend, 2, resolve_policy(cfg.precision, CPU, n))
    planned = states.per_rank_bytes_per_param(world)
    for rank in measured:
        assert rank["n"] == n
        for component in COMPONENTS:
            if component not in rank:
                continue  # ZeRO's gradients live in DeepSpeed's reduction buckets, not per tensor
            expected = planned[component] * n
            assert rank[component] == pytest.approx(expected, rel=0.05), (
                component,
                rank[component],
                expected,
            )


@pytest.mark.e2e
def test_plan_cli_prints_components_and_policy():
    result = run_cli(
        "plan",
        "configs/tiny.yaml",
        "--world-size",
        "64",
        "parallel.backend=zero",
        "parallel.zero_stage=3",
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "compute             bf16" in out or "compute             fp32" in out
    for component in COMPONENTS:
        assert component in out
    assert "zero-3" in out and "ZeRO paper" in out


@pytest.mark.unit
def test_activation_estimate_matches_what_autograd_saves(micro):
    """FP32 compute (no autocast casts): the bytes autograd keeps for backward in one forward and
    loss, weights excluded, against the plan's per-token estimate."""
    from torch import nn

    from bigtrain.model import build_model
    from bigtrain.plan.footprint import activation_bytes_per_token
    from bigtrain.plan.shapes import model_shape

    cfg = micro()
    model = build_model(cfg.model, 384)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if not isinstance(t, nn.Parameter) and storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    ids = torch.randint(0, 384, (8, 32))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(ids)
        torch.nn.functional.cross_entropy(logits.reshape(-1, 384), ids.reshape(-1))
    measured = sum(saved.values()) / ids.numel()
    estimate = activation_bytes_per_token(model_shape(cfg.model, cfg.data), "none", 4, 4)
    assert estimate["layers"] + estimate["head"] == pytest.approx(measured, rel=0.02)


@pytest.mark.unit
def test_largest_micro_batch_for_llama_70b_on_64_gpus_by_hand():
    from bigtrain.plan.text import plan_text

    cfg = load_config(["configs/llama-70b.yaml"])
    h100 = Hardware("cuda", "H100", cuda_capability=(9, 0))
    text = plan_text(planned(cfg, 64, h100), gpu_memory=80 * 2**30)
    # FSDP2: 16 B/param over 64 ranks; two gathered BF16 blocks + one FP32 gradient block
    states = 16 * 68_976_648_192 / 64
    transient = 855_654_400 * (2 + 2 + 4)
    reserve = 2**30 + 4 * 2**30
    # block checkpointing, per token: the BF16 block inputs of 80 layers, the head (final RMSNorm
    # keeps its FP32 input and normalised value, lm_head input, FP32 log-softmax), one recomputed
    # layer (two RMSNorms, qkv input, q/k/v, attention output, up input, SwiGLU) and the logits
    # (BF16 + FP32)
    h, kv, f, vocab = 8192, 1024, 28672, 32000
    layer = 2 * 8 * h + 2 * (h + (h + 2 * kv) + h + h) + 4 * f * 2
    per_token = 80 * 2 * h + (8 * h + 2 * h + 4 * vocab) + layer + 6 * vocab
    expected = int((80 * 2**30 - reserve - states - transient) // (per_token * 4096))
    assert expected == 6
    assert "  block              6  <- parallel.activation_checkpointing" in text
    assert "selective          0 (does not fit)" in text


@pytest.mark.e2e
def test_plan_cli_parses_gpu_memory_and_rejects_nonsense():
    ok = run_cli("plan", "configs/llama-1b.yaml", "--gpu-memory", "80GB")
    assert ok.returncode == 0, ok.stderr
    assert "largest micro-batch on 74.5 GiB per GPU" in ok.stdout
    bad = run_cli("plan", "configs/llama-1b.yaml", "--gpu-memory", "lots")
    assert bad.returncode == 2 and "--gpu-memory got 'lots'" in bad.stderr
    bare = run_cli("plan", "configs/llama-1b.yaml", "--gpu-memory", "80")  # was 80 bytes
    assert bare.returncode == 2 and bare.stdout == "", bare.stdout
    assert bare.stderr == (
        "bigtrain: error: --gpu-memory got '80' without a unit: give one, e.g. 80GiB or 80GB "
        "(they differ by 7%; nvidia-smi shows MiB)\n"
    )


@pytest.mark.unit
@pytest.mark.parametrize(
    ("name", "params"),
    [("gpt2-124m", 124_475_904), ("llama-1b", 1_235_814_400), ("llama-7b", 6_738_415_616)],
)
def test_recipes_have_the_published_sizes(name, params):
    cfg = load_config([f"configs/{name}.yaml"])
    assert count_params(meta_model(cfg.model, cfg.data))[0] == params


@pytest.mark.unit
def test_hsdp_traffic_per_mesh_axis_by_hand():
    """Shard 4 x replicate 2, 1000 parameters, 3 micro-batches, resharded after forward: 6 BF16
    all-gathers and one FP32 reduce-scatter over shard, one FP32 all-reduce of the 250-element
    shard over replicate (ring: (g - 1) / g of the data in each, twice for an all-reduce)."""
    from bigtrain.parallel.layout import Layout
    from bigtrain.plan.comm import fsdp_traffic

    cfg = load_config(
        [], ["parallel.backend=fsdp", "parallel.replicate=2", "train.grad_accum_steps=3"]
    )
    layout = Layout.of(cfg.parallel, 8)
    traffic = fsdp_traffic(cfg.parallel, 3, layout, 1000, gathered_itemsize=2, reduce_itemsize=4)
    assert [(t.axis, t.size, t.collective) for t in traffic] == [
        ("shard", 4, "all-gather x 6"),
        ("shard", 4, "reduce-scatter x 1"),
        ("replicate", 2, "all-reduce x 1"),
    ]
    assert [t.bytes_per_step for t in traffic] == [6 * 750 * 2, 750 * 4, 2 * 125 * 4]


@pytest.mark.unit
def test_hsdp_plan_divides_the_states_by_the_shard_degree_only():
    from bigtrain.plan.text import plan_text

    cfg = load_config(["configs/llama-70b.yaml", "configs/parallel/hsdp.yaml"])
    h100 = Hardware("cuda", "H100", cuda_capability=(9, 0))
    text = plan_text(planned(cfg, 512, h100))
    # 16 B/param over the 64 ranks of a replica (not 512): 1 B/param for the states
    assert "memory per rank, fsdp (states sharded over 64 ranks):" in text
    assert f"{16 / 64 * 68_976_648_192 / 2**30:.1f} GiB" in text
    assert "mesh replicate 8 x shard 64:" in text
    all_reduce = 2 * 7 / 8 * 68_976_648_192 / 64 * 4 / 2**30
    assert f"replicate (   8) all-reduce x 1 {all_reduce:>10.1f} GiB" in text


@pytest.mark.unit
def test_tensor_parallel_plan_counts_the_split_layers_and_the_tp_all_reduces():
    """A 2-block Llama (width 64, 2 of 4 heads for k/v, MLP 128) under tp 2 x shard 2: q/k/v,
    gate/up colwise and o/down rowwise split 36,864 parameters per block over tp; FSDP2 shards
    the rest and the tp slice over shard; each micro-batch all-reduces the residual stream
    7 times per block (2 rowwise outputs forward, 5 colwise input gradients backward)."""
    from bigtrain.parallel.layout import Layout
    from bigtrain.plan.comm import fsdp_traffic, tp_split

    cfg = load_config(
        [],
        [
            "model.kind=hf",
            "model.hf_config={model_type: llama, hidden_size: 64, intermediate_size: 128, "
            "num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2}",
            "data.vocab_size=384",
            "parallel.backend=fsdp",
            "parallel.tensor_parallel=2",
            "parallel.tp_plan={'self_attn.[qkv]_proj': colwise, self_attn.o_proj: rowwise, "
            "mlp.gate_proj: colwise, mlp.up_proj: colwise, mlp.down_proj: rowwise}",
            "train.grad_accum_steps=3",
        ],
    )
    split = tp_split(meta_model(cfg.model, cfg.data), cfg.parallel.tp_plan)
    per_block = 64 * 64 + 2 * 32 * 64 + 64 * 64 + 3 * 128 * 64
    assert (split.split_params, split.colwise, split.rowwise) == (2 * per_block, 5, 2)
    n = 100_000
    layout = Layout.of(cfg.parallel, 4)
    traffic = fsdp_traffic(cfg.parallel, 3, layout, n, 2, 4, split, activation_bytes=1000.0)
    held = n - per_block  # the unsplit part, plus half of the split one
    assert [(t.axis, t.collective) for t in traffic] == [
        ("tp", "all-reduce x 42"),
        ("shard", "all-gather x 6"),
        ("shard", "reduce-scatter x 1"),
    ]
    assert [t.bytes_per_step for t in traffic] == [42 * 1000.0, 6 * held, 2 * held]


@pytest.mark.unit
def test_the_gpt2_preset_splits_all_but_the_fused_qkv_layer():
    """configs/parallel/tp2-hf-gpt2.yaml on a 2-block transformers GPT-2 (width 64, MLP 256):
    c_fc, attn.c_proj and mlp.c_proj are split over tp; c_attn (colwise_qkv) stays whole but
    all-reduces its input gradient like a colwise layer."""
    from bigtrain.plan.comm import tp_split

    cfg = load_config(
        ["configs/parallel/tp2-hf-gpt2.yaml"],
        [
            "model.kind=hf",
            "model.hf_config={model_type: gpt2, n_embd: 64, n_layer: 2, n_head: 4}",
            "data.vocab_size=384",
        ],
    )
    split = tp_split(meta_model(cfg.model, cfg.data), cfg.parallel.tp_plan)
    per_block = (64 * 64 + 64) + (64 * 256 + 256) + (256 * 64 + 64)
    assert (split.split_params, split.colwise, split.rowwise) == (2 * per_block, 2, 2)


@pytest.mark.unit
def test_the_gpt_plan_counts_vocabulary_and_sequence_parallel_traffic():
    """bigtrain's GPT (2 Llama-style blocks, width 64, 2 of 4 heads for k/v, MLP 192, tied
    vocabulary of 384) under tp 2 x shard 2: q/k/v, gate/up, proj/down and the shared table are
    split; per micro-batch each block all-gathers and reduce-scatters its attention and MLP
    inputs/outputs forward and backward (4 each), lm_head's input once more: 9 per micro-batch,
    27 over 3; the activations per rank halve."""
    from bigtrain.parallel.layout import Layout
    from bigtrain.plan.comm import fsdp_traffic, tp_split
    from bigtrain.plan.text import plan_text

    overrides = [
        "data.vocab_size=384",
        "model.position=rope",
        "model.norm=rmsnorm",
        "model.mlp=swiglu",
        "model.bias=false",
        "model.n_layers=2",
        "model.n_heads=4",
        "model.n_kv_heads=2",
        "model.d_model=64",
        "parallel.backend=fsdp",
        "train.grad_accum_steps=3",
    ]
    cfg = load_config([], [*overrides, "parallel.tensor_parallel=2"])
    split = tp_split(meta_model(cfg.model, cfg.data), {})
    per_block = 64 * 64 + 2 * 32 * 64 + 64 * 64 + 3 * 192 * 64
    assert split.sequence_parallel and (split.colwise, split.rowwise) == (5, 2)
    assert split.split_params == 2 * per_block + 384 * 64
    layout = Layout.of(cfg.parallel, 4)
    traffic = fsdp_traffic(cfg.parallel, 3, layout, 100_000, 2, 4, split, activation_bytes=1000.0)
    assert traffic[0].collective == "all-gather + reduce-scatter x 27"
    assert traffic[0].bytes_per_step == 2 * 27 * 500.0
    split = plan_text(planned(cfg, 4, CPU))
    whole = plan_text(planned(load_config([], overrides), 2, CPU))  # the same data-parallel size
    assert "per rank, split 2 ways (tp 2)" in split

    def kept_without_checkpointing(text: str) -> float:
        row = next(line for line in text.splitlines() if line.strip().startswith("none "))
        value, unit = row.split()[1:3]
        return float(value) * {"KiB": 2**10, "MiB": 2**20}[unit]

    assert kept_without_checkpointing(split) == pytest.approx(
        kept_without_checkpointing(whole) / 2,
        rel=0.05,  # as printed: 3 digits
    )
