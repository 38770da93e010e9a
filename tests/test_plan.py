"""`bigtrain plan` against the ZeRO paper and against the storage the tensors really hold."""

from __future__ import annotations

import pytest
import torch

from bigtrain.build import build_trainer
from bigtrain.config import load_config
from bigtrain.parallel.env import read_env, shutdown
from bigtrain.plan import COMPONENTS, bigtrain_layout, count_params, zero_paper_layout
from bigtrain.precision import Hardware, resolve_policy
from tests.conftest import micro_overrides, run_cli
from tests.distributed import run_distributed

CPU = Hardware("cpu", "test CPU", cpu_bf16=True)


@pytest.mark.parametrize(("stage", "gigabytes"), [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_figure(stage, gigabytes):
    """Figure 1 of the ZeRO paper: 7.5B parameters, 64 data-parallel ranks, mixed-precision Adam."""
    layout = zero_paper_layout(stage)
    per_rank = sum(layout.per_rank_bytes_per_param(1 if stage == 0 else 64).values()) * 7.5e9
    assert per_rank / 1e9 == pytest.approx(gigabytes, abs=0.05)


def test_param_count_matches_the_built_model(micro):
    cfg = micro()
    n, block = count_params(cfg)
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
    trainer = build_trainer(cfg, read_env(), log=lambda *_: None)
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
                "n": trainer.context["num_params"],
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
            "n": trainer.context["num_params"],
        }
    finally:
        trainer.callbacks.close()
        shutdown(clean=False)


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
    n, _ = count_params(cfg)
    layout = bigtrain_layout(backend, 2, resolve_policy(cfg.precision, CPU, n))
    planned = layout.per_rank_bytes_per_param(world)
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
