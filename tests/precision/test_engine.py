"""The precision engine inside real runs: loss scaling across ranks, FP32 islands, schedules,
low-precision optimizer states on every backend."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from bigtrain.build import build_trainer
from bigtrain.config import load_config
from bigtrain.errors import ConfigError
from bigtrain.parallel.env import DistEnv, read_env, shutdown
from bigtrain.runner import run
from bigtrain.store.rundir import read_jsonl
from tests.conftest import micro_overrides
from tests.distributed import run_distributed, train_run


def deepspeed_supports_fp16() -> bool:
    from deepspeed.accelerator import get_accelerator

    return bool(get_accelerator().is_fp16_supported())


@pytest.mark.distributed
@pytest.mark.parametrize("backend", ["fsdp", "zero"])
def test_fp16_overflow_is_skipped_by_every_rank_and_backs_off(
    tmp_path, corpus_files, cache_dir, backend
):
    args = micro_overrides(tmp_path / backend, corpus_files, cache_dir) + [
        f"parallel.backend={backend}",
        "precision.compute_dtype=fp16",
        "precision.loss_scale=1024",
        "precision.loss_scale_hysteresis=1",
        "precision.loss_scale_growth_interval=1000",
        "train.max_steps=6",
        "train.log_every=1",
        "drill.rank=1",
        "drill.inf_grad_step=[3]",
        "train.eval_every=0",
        "checkpoint.every=0",
    ]
    if backend == "zero" and not deepspeed_supports_fp16():
        # DeepSpeed's CPU accelerator has FP16 only with AVX512-FP16/AMX: a clear config error.
        with pytest.raises(AssertionError, match="accelerator does not support fp16"):
            run_distributed(train_run, 2, args)
        return
    r0, r1 = run_distributed(train_run, 2, args)
    for r in (r0, r1):
        assert r["final"]["skipped_steps"] == 1 and r["final"]["anomalies"] == 0
    overflow = [e for e in r0["events"] if e["kind"] == "overflow"]
    assert [e["step"] for e in overflow] == [3]
    scales = {m["step"]: m["loss_scale"] for m in r0["metrics"] if "loss_scale" in m}
    assert scales[2] == 1024 and scales[3] == 512 and scales[6] == 512
    assert r0["final"]["fingerprint"] == r1["final"]["fingerprint"]


def islands_dtypes(args: list[str]) -> dict:
    trainer = build_trainer(load_config([], args), read_env())
    try:
        seen: dict[str, set] = {}
        for name, m in trainer.backend.model.named_modules():
            if isinstance(m, nn.Linear):
                m.register_forward_hook(
                    lambda mod, i, o, name=name: seen.setdefault(name, set()).add(str(o.dtype))
                )
        trainer.train_step()
        return {k: sorted(v) for k, v in seen.items()}
    finally:
        trainer.callbacks.close()
        shutdown(clean=False)


@pytest.mark.distributed
@pytest.mark.parametrize(("backend", "world"), [("local", 1), ("fsdp", 2)])
def test_fp32_modules_run_in_fp32(tmp_path, corpus_files, cache_dir, backend, world):
    args = micro_overrides(tmp_path / backend, corpus_files, cache_dir) + [
        f"parallel.backend={backend}",
        "precision.compute_dtype=bf16",
        "precision.fp32_modules=[lm_head,'*.attn.q']",
        "train.eval_every=0",
    ]
    for seen in run_distributed(islands_dtypes, world, args):
        assert seen["lm_head"] == ["torch.float32"]
        assert seen["blocks.0.attn.q"] == seen["blocks.1.attn.q"] == ["torch.float32"]
        assert seen["blocks.0.attn.k"] == ["torch.bfloat16"]  # *.attn.q selects q alone
        assert seen["blocks.0.mlp.up"] == ["torch.bfloat16"]


SCHEDULE = (
    "precision.schedule=[{until: 0.25, compute_dtype: fp32}, {until: 1.0, compute_dtype: bf16}]"
)


@pytest.mark.e2e
def test_schedule_switches_dtype_logs_phases_and_resumes_in_the_right_phase(micro):
    cfg = micro(
        "train.max_steps=8",
        "train.log_every=1",
        SCHEDULE,
        "train.stop_at_step=5",
        "train.eval_every=0",
    )
    seen = []
    trainer = build_trainer(cfg, DistEnv())
    trainer.backend.model.blocks[0].mlp.up.register_forward_hook(
        lambda m, i, o: seen.append(o.dtype)
    )
    trainer.fit()
    trainer.callbacks.close()
    assert seen[:2] == [torch.float32, torch.float32] and set(seen[2:]) == {torch.bfloat16}
    out = Path(cfg.train.out_dir)
    phases = {
        m["step"]: m["precision_phase"] for m in read_jsonl(out / "metrics.jsonl") if "loss" in m
    }
    assert phases[1] == phases[2] == "fp32" and phases[3] == phases[5] == "bf16"
    switch = [e for e in read_jsonl(out / "events.jsonl") if e["kind"] == "precision_phase"]
    assert [(e["step"], e["previous"], e["phase"]) for e in switch] == [(2, "fp32", "bf16")]
    # resumed at step 5: starts in bf16 (one switch event at the resume), ends the run
    final = run(
        micro("train.max_steps=8", "train.log_every=1", SCHEDULE, "checkpoint.every=0"),
        DistEnv(),
    )
    assert final["step"] == 8
    phases = [
        m["precision_phase"]
        for m in read_jsonl(out / "metrics.jsonl")
        if "loss" in m and m["step"] > 5
    ]
    assert phases == ["bf16"] * 3


@pytest.mark.distributed
def test_fsdp_schedule_runs(tmp_path, corpus_files, cache_dir):
    args = micro_overrides(tmp_path / "f", corpus_files, cache_dir) + [
        "parallel.backend=fsdp",
        "train.max_steps=4",
        "train.log_every=1",
        SCHEDULE,
        "train.eval_every=0",
    ]
    r0, _ = run_distributed(train_run, 2, args)
    assert [m["precision_phase"] for m in r0["metrics"] if "loss" in m] == [
        "fp32",
        "bf16",
        "bf16",
        "bf16",
    ]


@pytest.mark.unit
def test_zero_refuses_a_schedule_and_fp32_modules(micro):
    from bigtrain.parallel.backends.zero import check_zero_precision
    from bigtrain.precision import Hardware, resolve_policy

    cpu = Hardware("cpu", "cpu", cpu_bf16=True)
    for extra, key in (
        (SCHEDULE, "precision.schedule"),
        ("precision.fp32_modules=[lm_head]", "precision.fp32_modules"),
    ):
        cfg = micro("parallel.backend=zero", extra)
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            check_zero_precision(resolve_policy(cfg.precision, cpu, 10**6))


@pytest.mark.distributed
@pytest.mark.parametrize(("backend", "world"), [("fsdp", 2), ("zero", 2), ("local", 1)])
def test_fp32_state_checkpoint_resumes_with_fp16_states(
    tmp_path, corpus_files, cache_dir, backend, world
):
    base = micro_overrides(tmp_path / backend, corpus_files, cache_dir) + [
        f"parallel.backend={backend}",
        "train.max_steps=6",
        "train.eval_every=0",
        "checkpoint.every=3",
    ]
    run_distributed(train_run, world, base + ["train.stop_at_step=3"])
    resumed = run_distributed(train_run, world, base + ["precision.optimizer_state_dtype=fp16"])[0]
    assert resumed["final"]["step"] == 6
    assert [e for e in resumed["events"] if e["kind"] == "resume"]
    losses = [m["loss"] for m in resumed["metrics"] if "loss" in m]
    assert all(
        loss == loss for loss in losses
    )  # finite: the FP32 moments were re-encoded, not garbage


@pytest.mark.e2e
def test_low_precision_states_reach_the_fp32_loss(micro):
    """200 steps of the micro model: BF16 (stochastic) and FP16 (scaled) states end within 1% of
    FP32 states' training loss. At a stable learning rate: at 3e-3 the micro model has loss spikes
    whose timing any rounding difference shifts, so single runs differ by a few % either way."""
    opts = [
        "train.max_steps=200",
        "train.log_every=50",
        "train.eval_every=0",
        "checkpoint.every=0",
        "optim.lr=1e-3",
    ]
    ref = run(micro(*opts, out="fp32"), DistEnv())["loss"]
    for dtype in ("bf16", "fp16"):
        loss = run(micro(*opts, f"precision.optimizer_state_dtype={dtype}", out=dtype), DistEnv())[
            "loss"
        ]
        assert loss == pytest.approx(ref, rel=0.01), (dtype, loss, ref)


@pytest.mark.e2e
def test_overflow_at_the_minimum_scale_is_an_anomaly(micro):
    from bigtrain.errors import AbortRun

    cfg = micro(
        "precision.compute_dtype=fp16",
        "precision.loss_scale=2",
        "precision.loss_scale_min=2",
        "precision.loss_scale_hysteresis=1",
        "monitor.nonfinite=abort",
        "drill.inf_grad_step=[2]",
        "train.max_steps=4",
        "checkpoint.every=0",
        "train.eval_every=0",
    )
    with pytest.raises(AbortRun, match="loss_scale_at_minimum"):
        run(cfg, DistEnv())
    events = read_jsonl(Path(cfg.train.out_dir) / "events.jsonl")
    anomaly = [e for e in events if e["kind"] == "anomaly"]
    assert anomaly[0]["step"] == 2 and anomaly[0]["metric"] == "loss_scale_at_minimum"


@pytest.mark.unit
def test_adaptive_clipping_uses_the_percentile_of_healthy_norms():
    from bigtrain.precision.clip import ClipThreshold

    clip = ClipThreshold(fixed=1.0, adaptive=True, percentile=50, window=100)
    for norm in range(1, 10):
        clip.record(float(norm))
    assert clip.value() == 1.0  # fewer than 10 healthy steps: the fixed value
    clip.record(10.0)
    assert clip.value() == pytest.approx(5.5)  # median of 1..10
    restored = ClipThreshold(fixed=1.0, adaptive=True, percentile=50, window=100)
    restored.load_state_dict(clip.state_dict())
    assert restored.value() == clip.value()
    assert ClipThreshold(fixed=1.0, adaptive=False, percentile=50, window=100).value() == 1.0


@pytest.mark.e2e
def test_adaptive_clipping_in_a_run(micro):
    cfg = micro(
        "precision.adaptive_clip=true",
        "precision.adaptive_clip_window=20",
        "train.max_steps=14",
        "train.log_every=1",
        "optim.grad_clip=0.01",
        "train.eval_every=0",
        "checkpoint.every=0",
    )
    trainer = build_trainer(cfg, DistEnv())
    trainer.fit()
    trainer.callbacks.close()
    assert (
        len(trainer.clip.history) == 14 and trainer.clip.value() > 0.01
    )  # learned from the norms seen
    assert trainer.setup.policy.to_dict()["gradient clipping"]["choice"] == "adaptive"
