"""FP8 linears (precision/fp8.py): conversion and its exclusions, the policy's choice and table,
bad configs, the layer's switch and statistics, and the health callback's fallback on a run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from bigtrain.build import build_trainer
from bigtrain.config.schema import Fp8Config, PrecisionConfig
from bigtrain.errors import ConfigError
from bigtrain.parallel.env import DistEnv
from bigtrain.precision import Hardware, resolve_policy
from bigtrain.precision.fp8 import (
    STATS,
    convert_to_fp8,
    float8_config,
    is_fp8_linear,
    make_fp8_linear,
)
from bigtrain.runner import run
from bigtrain.store.rundir import read_jsonl
from tests.conftest import run_cli

pytest.importorskip("torchao")

H100 = Hardware("cuda", "H100", cuda_capability=(9, 0))
A100 = Hardware("cuda", "A100", cuda_capability=(8, 0))
CPU = Hardware("cpu", "CPU", cpu_bf16=True)


def policy_of(hw: Hardware, params: int, **fp8) -> object:
    cfg = PrecisionConfig(compute_dtype="bf16", fp8=Fp8Config(**fp8))
    return resolve_policy(cfg, hw, params)


@pytest.mark.unit
def test_auto_turns_fp8_on_only_with_fp8_tensor_cores_and_a_large_model():
    on = policy_of(H100, 8_000_000_000)
    assert on.fp8 and on.fp8_auto and "FP8 tensor cores" in on.reasons["fp8"]
    assert not policy_of(A100, 8_000_000_000).fp8  # sm80: no FP8 tensor cores
    assert "sm80" in policy_of(A100, 8_000_000_000).reasons["fp8"]
    small = policy_of(H100, 300_000_000)
    assert not small.fp8 and "< 1B" in small.reasons["fp8"]
    assert not policy_of(CPU, 8_000_000_000).fp8  # off on CPU unless asked for
    asked = policy_of(CPU, 1_000_000, enabled=True)
    assert asked.fp8 and not asked.fp8_auto
    rows = {r[0]: r for r in asked.rows()}
    assert rows["fp8 linears"][2] == "precision.fp8.enabled=true"
    assert {r[0]: r for r in small.rows()}["fp8 linears"][1] == "off"


@pytest.mark.unit
@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"compute_dtype": "fp32"}, "precision.fp8.enabled=true with precision.compute_dtype=fp32"),
        ({"compute_dtype": "fp16"}, "precision.fp8.enabled=true with precision.compute_dtype=fp16"),
    ],
)
def test_fp8_needs_bf16_compute(overrides, match):
    cfg = PrecisionConfig(fp8=Fp8Config(enabled=True), **overrides)
    with pytest.raises(ConfigError, match=match) as e:
        resolve_policy(cfg, CPU, 1_000_000)
    assert "precision.compute_dtype=bf16" in str(e.value)  # says what works


@pytest.mark.unit
def test_fp8_asked_for_makes_auto_compute_bf16_even_without_native_bf16():
    no_bf16 = Hardware("cpu", "CPU", cpu_bf16=False)
    policy = resolve_policy(PrecisionConfig(fp8=Fp8Config(enabled=True)), no_bf16, 1_000_000)
    assert policy.compute_dtype == torch.bfloat16 and policy.fp8
    assert policy.reasons["compute"].startswith("precision.fp8.enabled=true")
    assert resolve_policy(PrecisionConfig(), no_bf16, 1_000_000).compute_dtype == torch.float32


@pytest.mark.unit
def test_a_phase_with_fp8_needs_fp8_enabled_and_bf16():
    from bigtrain.config.schema import PrecisionPhase

    cfg = PrecisionConfig(
        compute_dtype="bf16", schedule=[PrecisionPhase(until=1.0, compute_dtype="bf16", fp8=True)]
    )
    with pytest.raises(ConfigError, match=r"precision.schedule\[0\].fp8=true"):
        resolve_policy(cfg, CPU, 1_000_000)
    cfg = PrecisionConfig(
        compute_dtype="bf16",
        fp8=Fp8Config(enabled=True),
        schedule=[
            PrecisionPhase(until=0.2, compute_dtype="fp32"),
            PrecisionPhase(until=1.0, compute_dtype="bf16"),
        ],
    )
    with pytest.raises(ConfigError, match=r"precision.schedule\[0\]: FP8 layers"):
        resolve_policy(cfg, CPU, 1_000_000)
    cfg.schedule[0].fp8 = False
    phases = resolve_policy(cfg, CPU, 1_000_000).phases
    assert [p.fp8 for p in phases] == [False, True] and phases[1].name == "fp8+bf16"


class Routed(nn.Module):
    """An MoE block as transformers writes them: a `gate` router beside `experts`."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(64, 8, bias=False)
        self.experts = nn.ModuleList(nn.Linear(64, 64) for _ in range(2))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(64, 256)
        self.odd = nn.Linear(64, 50)  # 50 is not a multiple of 16
        self.moe = Routed()
        self.lm_head = nn.Linear(64, 384, bias=False)
        self.big = nn.Linear(4096, 2048, bias=False)


@pytest.mark.unit
def test_exclusions_are_resolved_each_with_its_reason():
    with torch.device("meta"):
        net = Net()
    layers, excluded = convert_to_fp8(net, Fp8Config(enabled=True), all_gather=False)
    assert set(layers) == {"up", "big", "moe.experts.0", "moe.experts.1"}
    assert all(is_fp8_linear(m) for m in (net.up, net.big))
    assert net.up.weight.shape == (256, 64)  # the same Parameter objects
    assert excluded["lm_head"] == "precision.fp8.exclude '*lm_head'"
    assert "divisible by 16" in excluded["odd"] and excluded["odd"].startswith("50x64")
    assert excluded["moe.gate"] == "MoE router: its logits choose the experts"
    assert not is_fp8_linear(net.odd) and not is_fp8_linear(net.moe.gate)
    # auto: torchao's performance filter also leaves out layers too small to pay
    with torch.device("meta"):
        net = Net()
    layers, excluded = convert_to_fp8(net, Fp8Config(), all_gather=False, auto=True)
    assert set(layers) == {"big"}
    assert "too small for FP8 to pay" in excluded["up"]
    with torch.device("meta"):
        net = Net()
    with pytest.raises(ConfigError, match="selects no linear layer"):
        convert_to_fp8(net, Fp8Config(modules=["nothing*"]), all_gather=False)
    with torch.device("meta"):
        net = Net()
    _, excluded = convert_to_fp8(net, Fp8Config(), all_gather=False, fp32_patterns=("moe",))
    assert excluded["moe.experts.0"] == "kept in FP32 by precision.fp32_modules 'moe'"


def fp8_layer(seed: int = 0, recipe: str = "tensorwise") -> tuple[nn.Linear, nn.Module]:
    torch.manual_seed(seed)
    plain = nn.Linear(64, 128)
    source = nn.Linear(64, 128)
    source.load_state_dict(plain.state_dict())
    return plain, make_fp8_linear(source, float8_config(Fp8Config(recipe=recipe), False))


@pytest.mark.unit
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_the_switch_gives_bf16_exactly_and_fp8_within_its_rounding(recipe):
    plain, layer = fp8_layer(recipe=recipe)
    x = torch.randn(32, 64)
    with torch.autocast("cpu", torch.bfloat16):
        reference = plain(x)
        layer.fp8 = False
        bf16 = layer(x)
        layer.fp8, layer.watch = True, True
        fp8 = layer(x)
    assert bf16.dtype == fp8.dtype == torch.bfloat16  # the CPU's autocast dtype, not CUDA's
    torch.testing.assert_close(bf16, reference, rtol=0, atol=0)
    error = ((fp8.float() - reference.float()).norm() / reference.float().norm()).item()
    # e4m3 keeps 3 mantissa bits: each of x and W rounds by <= 2^-4 relative, ~3.6% RMS; the
    # products' errors average out to a few percent of the output.
    assert 0.005 < error < 0.1, error
    stats = dict(zip(STATS, layer.fp8_stats.tolist(), strict=True))
    assert stats["amax"] == pytest.approx(x.abs().max().item(), rel=1e-2)  # BF16 input
    assert stats["error"] == pytest.approx(error, rel=0.05) and stats["nonfinite"] == 0
    assert not layer.watch  # the step's first forward only
    fp8.float().sum().backward()
    assert layer.weight.grad.dtype == torch.float32 and layer.weight.grad.abs().sum() > 0


@pytest.mark.unit
def test_the_drills_break_the_cast_and_flush_the_inputs():
    _, layer = fp8_layer()
    x = torch.randn(32, 64)
    layer.drill_amax = math.inf
    with torch.autocast("cpu", torch.bfloat16):
        y = layer(x)
    assert not torch.isfinite(y).all()
    assert layer.fp8_stats[STATS.index("nonfinite")] == 1  # finite input, non-finite result
    layer.fp8_stats.zero_()
    layer.drill_amax, layer.drill_outlier, layer.watch = None, 1e6, True
    with torch.autocast("cpu", torch.bfloat16):
        layer(x)
    stats = dict(zip(STATS, layer.fp8_stats.tolist(), strict=True))
    assert stats["error"] > 0.25 and stats["underflow"] > 0.05  # the others flushed
    layer.fp8 = False  # the same drill in BF16 is fine: no nonfinite flag, no error measured
    layer.fp8_stats.zero_()
    with torch.autocast("cpu", torch.bfloat16):
        assert torch.isfinite(layer(x)).all()
    assert layer.fp8_stats[1:].abs().sum() == 0


@pytest.mark.unit
def test_bad_fp8_configs_name_the_key(micro):
    with pytest.raises(ConfigError, match="precision.fp8.recipe"):
        micro("precision.fp8.recipe=delayed")
    with pytest.raises(ConfigError, match="precision.fp8.check_every"):
        micro("precision.fp8.check_every=-1")
    on = ("precision.fp8.enabled=true", "precision.compute_dtype=bf16")
    cases = [
        (("parallel.backend=zero",), "parallel.backend=zero"),
        (("precision.fp8.all_gather=true",), "precision.fp8.all_gather"),
        (
            ("precision.int8.enabled=true", "precision.int8.exclude=[]"),
            "precision.fp8.modules and precision.int8.modules both select",
        ),
        (("precision.fp8.modules=[nothing]",), "selects no linear layer"),
    ]
    for i, (extra, match) in enumerate(cases):
        with pytest.raises(ConfigError, match=match):
            build_trainer(micro(*on, *extra, out=f"bad{i}"), DistEnv())


FP8_RUN = (
    "precision.compute_dtype=bf16",
    "precision.fp8.enabled=true",
    "precision.fp8.check_every=2",
    "train.max_steps=8",
    "train.log_every=1",
    "train.eval_every=0",
    "checkpoint.every=4",
)


def losses(out: str) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_jsonl(Path(out) / "metrics.jsonl")}


@pytest.mark.e2e
def test_fp8_trains_near_bf16_and_resumes_either_way(micro):
    """FP8 (tensorwise) tracks the BF16 run over 8 steps; a run saved with FP8 exports to Hugging
    Face (logits checked) and resumes without FP8, and one saved without resumes with it (the
    checkpoint holds FP32 masters only)."""
    fp8 = micro(*FP8_RUN, out="fp8")
    bf16 = micro(*FP8_RUN, "precision.fp8.enabled=false", out="bf16")
    run(fp8, DistEnv())
    run(bf16, DistEnv())
    a, b = losses(fp8.train.out_dir), losses(bf16.train.out_dir)
    assert sorted(a) == sorted(b) == list(range(1, 9))
    # Measured: within 0.5% per step; FP8 rounding is a few percent per product, averaged.
    for step in a:
        assert a[step] == pytest.approx(b[step], rel=0.02), step
    assert a != b  # FP8 did run
    metrics = read_jsonl(Path(fp8.train.out_dir) / "metrics.jsonl")
    checked = [m for m in metrics if "fp8_error_max" in m]
    assert [m["step"] for m in checked] == [2, 4, 6, 8]
    assert all(0 < m["fp8_error_max"] < 0.25 and m["fp8_bf16_layers"] == 0 for m in checked)
    start = next(
        e for e in read_jsonl(Path(fp8.train.out_dir) / "events.jsonl") if e["kind"] == "start"
    )
    assert start["precision"]["fp8 linears"]["choice"].startswith("tensorwise: blocks.*")
    # the checkpoint exports to Hugging Face as any other: FP32 masters, logits checked
    hf = Path(fp8.train.out_dir) / "hf"
    ckpt = Path(fp8.train.out_dir) / "checkpoints/step_00000008"
    done = run_cli("export", str(ckpt), "--hf", str(hf), "--check")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["check"]["ok"]
    # FP8 -> BF16 and BF16 -> FP8 resumes from step 8 continue the run
    for src, flag in ((fp8, "false"), (bf16, "true")):
        out = Path(src.train.out_dir)
        cfg = micro(
            *FP8_RUN, f"precision.fp8.enabled={flag}", "train.max_steps=10", out=out.name + "-x"
        )
        resumed_dir = Path(cfg.train.out_dir)
        resumed_dir.mkdir(parents=True)
        (resumed_dir / "checkpoints").symlink_to(out / "checkpoints")
        final = run(cfg, DistEnv())
        assert final["step"] == 10 and math.isfinite(final["loss"])


@pytest.mark.e2e
def test_a_broken_amax_is_healed_and_its_layer_moves_to_bf16_for_good(micro):
    """drill.fp8_amax_step: blocks.1.mlp.up's FP8 cast gets an Inf amax at step 3 (first run
    and replay): the healer rolls back; the layer falls back to BF16 (reason nonfinite); the
    rerun of step 3 is clean; the BF16 set is in the checkpoint and survives the rollback."""
    cfg = micro(
        *FP8_RUN,
        "drill.fp8_amax_step=[3]",
        "drill.fp8_layer=blocks.1.mlp.up",
        out="amax",
    )
    final = run(cfg, DistEnv())
    out = Path(cfg.train.out_dir)
    events = read_jsonl(out / "events.jsonl")
    kinds = [e["kind"] for e in events]
    fallback = [e for e in events if e["kind"] == "fp8_fallback"]
    assert [(e["layer"], e["reason"]) for e in fallback] == [("blocks.1.mlp.up", "nonfinite")]
    assert "anomaly" in kinds and "replay" in kinds
    assert final["step"] == 8 and math.isfinite(final["loss"])
    saved = json.loads((out / "checkpoints/step_00000008/trainer.json").read_text())
    assert saved["callbacks"]["fp8"]["bf16"] == ["blocks.1.mlp.up"]
    checked = [m for m in read_jsonl(out / "metrics.jsonl") if "fp8_bf16_layers" in m]
    assert checked[-1]["fp8_bf16_layers"] == 1
    # resumed, the layer is in BF16 from the start and the policy table says so
    trainer = build_trainer(micro(*FP8_RUN, "train.max_steps=9", out="amax"), DistEnv())
    try:
        rows = {r[0]: r for r in trainer.setup.policy.rows()}
        assert rows["fp8 fell back"][1] == "blocks.1.mlp.up"
        assert not trainer.setup.fp8_layers["blocks.1.mlp.up"].fp8
    finally:
        trainer.callbacks.close()


@pytest.mark.e2e
def test_an_outlier_that_fp8_flushes_moves_its_layer_after_patience_checks(micro):
    cfg = micro(
        *FP8_RUN,
        "drill.fp8_outlier_from=3",
        "drill.fp8_layer=blocks.0.attn.v",
        out="outlier",
    )
    run(cfg, DistEnv())
    events = read_jsonl(Path(cfg.train.out_dir) / "events.jsonl")
    checks = [e for e in events if e["kind"] == "fp8_check"]
    fallback = [e for e in events if e["kind"] == "fp8_fallback"]
    assert [(e["layer"], e["step"], e["strikes"]) for e in checks] == [
        ("blocks.0.attn.v", 4, 1),
        ("blocks.0.attn.v", 6, 2),
    ]
    assert [(e["layer"], e["reason"], e["step"]) for e in fallback] == [
        ("blocks.0.attn.v", "error", 6)
    ]
    assert fallback[0]["error"] > 0.25
    assert "anomaly" not in [e["kind"] for e in events]  # the loss never broke: no rollback


@pytest.mark.e2e
def test_inputs_that_fp8_clips_move_their_layer_after_patience_checks(micro):
    """A stale amax 1,000x below the inputs' (drill.fp8_amax, finite: what a broken amax
    reduction or a delayed scale gives when the inputs grow) makes the cast saturate: FP8 clips
    the inputs to its range. The result stays finite, so only the checks see it: the error at
    steps 4 and 6, then the fallback (reason error)."""
    cfg = micro(
        *FP8_RUN,
        "drill.fp8_amax_step=[3,4,5,6,7,8]",
        "drill.fp8_amax=0.001",
        "drill.fp8_layer=blocks.0.mlp.up",
        out="clip",
    )
    run(cfg, DistEnv())
    events = read_jsonl(Path(cfg.train.out_dir) / "events.jsonl")
    checks = [(e["layer"], e["step"], e["strikes"]) for e in events if e["kind"] == "fp8_check"]
    fallback = [e for e in events if e["kind"] == "fp8_fallback"]
    assert checks == [("blocks.0.mlp.up", 4, 1), ("blocks.0.mlp.up", 6, 2)], checks
    assert [(e["layer"], e["reason"], e["seen_at"]) for e in fallback] == [
        ("blocks.0.mlp.up", "error", 6)
    ]
    assert fallback[0]["error"] > 0.25 and fallback[0]["nonfinite"] == 0


@pytest.mark.e2e
def test_the_precision_schedule_switches_fp8_by_phase(micro):
    """BF16 for the first quarter, FP8 after: the phase names the metrics carry, and error
    checks only in the FP8 phase."""
    cfg = micro(
        *FP8_RUN,
        "precision.schedule=[{until: 0.25, compute_dtype: bf16, fp8: false}, "
        "{until: 1.0, compute_dtype: bf16}]",
        out="schedule",
    )
    run(cfg, DistEnv())
    metrics = read_jsonl(Path(cfg.train.out_dir) / "metrics.jsonl")
    phases = {m["step"]: m["precision_phase"] for m in metrics}
    assert phases[1] == phases[2] == "bf16" and phases[3] == phases[8] == "fp8+bf16"
    assert [m["step"] for m in metrics if "fp8_error_max" in m] == [4, 6, 8]


@pytest.mark.unit
def test_the_plan_counts_fp8_gathers_and_compute():
    """bigtrain plan on an sm90 GPU: FP8 (auto from 1B) gathers the FP8 layers' weights in one
    byte, so the all-gather traffic and the transient weights shrink by their share, and the
    modelled compute by the recipe's published step speedup."""
    from bigtrain.config import load_config
    from bigtrain.plan.footprint import planned
    from bigtrain.plan.step_time import FP8_STEP_SPEEDUP, rank_traffic, step_time
    from tests.conftest import ROOT

    recipe = str(ROOT / "configs" / "llama-7b.yaml")  # FSDP2
    on = planned(load_config([recipe], []), 8, H100)
    off = planned(load_config([recipe], ["precision.fp8.enabled=false"]), 8, H100)
    assert on.policy.fp8 and on.policy.fp8_auto and on.policy.fp8_all_gather
    share = on.policy.fp8_share
    assert 0.5 < share < 1.0  # the blocks' linear layers; embeddings and lm_head are not
    gathers = {
        name: next(t for t in rank_traffic(run) if "all-gather" in t.collective).bytes_per_step
        for name, run in (("on", on), ("off", off))
    }
    assert gathers["on"] / gathers["off"] == pytest.approx(1 - share / 2, rel=1e-6)
    compute = step_time(on).parts["compute"] / step_time(off).parts["compute"]
    assert compute == pytest.approx((1 - share) + share / FP8_STEP_SPEEDUP["tensorwise"])
    zero = planned(load_config([recipe], ["parallel.backend=zero"]), 8, H100)
    assert not zero.policy.fp8 and "parallel.backend=zero" in zero.policy.reasons["fp8"]


@pytest.mark.e2e
@pytest.mark.parametrize("extra", [("parallel.activation_checkpointing=block",)], ids=["ac"])
def test_fp8_with_activation_checkpointing_trains_the_same_steps(micro, extra):
    """Recomputed forwards cast the same tensors to FP8 the same way: every loss equals the run
    without checkpointing, and the error checks (maxima) read the same."""
    plain = micro(*FP8_RUN, "checkpoint.every=0", out="plain")
    again = micro(*FP8_RUN, "checkpoint.every=0", *extra, out="again")
    run(plain, DistEnv())
    run(again, DistEnv())
    assert losses(again.train.out_dir) == losses(plain.train.out_dir)
    checks = [
        [m.get("fp8_error_max") for m in read_jsonl(Path(c.train.out_dir) / "metrics.jsonl")]
        for c in (plain, again)
    ]
    assert checks[0] == checks[1]


@pytest.mark.e2e
def test_compiled_blocks_run_fp8_checks_and_fallback_like_eager_ones(micro):
    """parallel.compile=true: inductor compiles each block with its FP8 layers. Checked steps (a
    BF16 reference in each layer), the broken-amax drill at step 3 and the layer's move to BF16
    afterwards (its `fp8` switch: a recompile) run as in eager mode. The losses agree to 5e-3 per
    step (8e-5 measured): inductor fuses the casts around the FP8 matmuls and may round a BF16
    value differently (BF16's step is 4e-3 relative)."""
    # Inductor's compile is the test's cost (~15 s per graph on 2 cores, cold): one block,
    # checked on every step, so two graphs (all FP8, and the drilled layer in BF16).
    drill = (
        "model.n_layers=1",
        "train.max_steps=4",
        "precision.fp8.check_every=1",
        "drill.fp8_amax_step=[3]",
        "drill.fp8_layer=blocks.0.mlp.up",
        "checkpoint.every=0",
    )
    eager = micro(*FP8_RUN, *drill, out="eager")
    compiled = micro(*FP8_RUN, *drill, "parallel.compile=true", out="compiled")
    run(eager, DistEnv())
    run(compiled, DistEnv())
    a, b = losses(eager.train.out_dir), losses(compiled.train.out_dir)
    assert sorted(a) == sorted(b) == list(range(1, 5))
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=5e-3), step
    checked_steps = []
    for cfg in (eager, compiled):
        events = read_jsonl(Path(cfg.train.out_dir) / "events.jsonl")
        moved = [(e["layer"], e["seen_at"]) for e in events if e["kind"] == "fp8_fallback"]
        assert moved == [("blocks.0.mlp.up", 3)], cfg.train.out_dir
        metrics = read_jsonl(Path(cfg.train.out_dir) / "metrics.jsonl")
        checked = [(m["step"], m["fp8_error_max"]) for m in metrics if "fp8_error_max" in m]
        assert [s for s, _ in checked][-4:] == [1, 2, 3, 4], checked  # again after the rollback
        # the drilled step's first run measured a non-finite error (logged as text); the others
        healthy = [e for s, e in checked[-4:]]
        assert all(isinstance(e, float) and 0 < e < 0.25 for e in healthy), checked
        checked_steps.append([s for s, _ in checked])
    assert checked_steps[0] == checked_steps[1]
    assert torch.compiler.is_compiling() is False


@pytest.mark.e2e
def test_an_moe_model_keeps_its_experts_and_routers_out_of_fp8_and_trains(micro):
    """bigtrain's MoE: attention in FP8; the batched experts excluded with the reason (no
    grouped FP8 GEMM on CPU); the router is no nn.Linear at all. Trains with the loss finite."""
    cfg = micro(
        *FP8_RUN, "model.moe.experts=4", "model.moe.top_k=2", "train.max_steps=3", out="moe"
    )
    final = run(cfg, DistEnv())
    start = next(
        e for e in read_jsonl(Path(cfg.train.out_dir) / "events.jsonl") if e["kind"] == "start"
    )
    policy = start["precision"]
    assert policy["fp8 linears"]["choice"].startswith("tensorwise: blocks.*.attn")
    assert "moe" not in policy["fp8 linears"]["choice"]
    excluded = policy["fp8 excluded"]
    assert "blocks.*.moe.experts" in excluded["choice"] and "lm_head" in excluded["choice"]
    assert "blocks.*.moe.experts: batched expert weights" in excluded["reason"]
    assert "lm_head: precision.fp8.exclude '*lm_head'" in excluded["reason"]
    assert math.isfinite(final["loss"])
