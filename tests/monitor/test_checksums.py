"""Gradient checksums (monitor/checksums.py): every parameter of bigtrain's GPT checked, healthy
gradients within rounding of their layers' inputs and output gradients, a scaled tensor far out,
through the monitor's one reduction and host read. On 2 FSDP2 ranks: tests/monitor/test_sharded.py;
in a training run (a replay, its event): tests/resilience/test_suspicion.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bigtrain.config import ModelConfig
from bigtrain.config.model import MoEConfig
from bigtrain.config.resilience import ChecksumConfig, MonitorConfig
from bigtrain.model.gpt import GPT
from bigtrain.model.moe import aux_grad_scale
from bigtrain.monitor.checksums import GradChecksums, mismatched, unsupported
from bigtrain.monitor.monitor import GradMonitor
from bigtrain.parallel.layout import Layout
from bigtrain.parallel.transforms import apply_activation_checkpointing
from bigtrain.utils.names import canonical_name

pytestmark = pytest.mark.unit

VOCAB, SEQ = 128, 16
LLAMA = dict(position="rope", norm="rmsnorm", mlp="swiglu", bias=False, tie_embeddings=False)
TENSOR = "blocks.1.attn.q.weight"


def model_of(**kw) -> GPT:
    cfg = dict(n_layers=2, n_heads=2, d_model=32, seq_len=SEQ, vocab_size=VOCAB) | kw
    return GPT(ModelConfig(**cfg), init_seed=0)


def names_of(model: torch.nn.Module) -> list[str]:
    return [canonical_name(n) for n, _ in model.named_parameters()]


def step(model, monitor: GradMonitor, dtype=torch.float32, scale: float = 1.0, micro: int = 2):
    """One step's micro-batches (the loss scaled by `scale` as a loss scaler would), gradients
    left as backward made them."""
    monitor.begin(1)
    model.zero_grad()
    generator = torch.Generator().manual_seed(1)
    for _ in range(micro):
        x = torch.randint(0, VOCAB, (4, SEQ), generator=generator)
        with aux_grad_scale(model, scale / micro):  # an MoE model's own losses
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                logits = model(x)
            loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), x.reshape(-1))
            (loss * scale / micro).backward()


def monitor_of(model, cfg: MonitorConfig | None = None) -> GradMonitor:
    cfg = cfg or MonitorConfig()
    names = names_of(model)
    checksums = GradChecksums(cfg.checksum, model, names, None, 1, torch.device("cpu"))
    checksums.mark_checkpointed(model)
    return GradMonitor(cfg, names, torch.device("cpu"), False, checksums=checksums)


def residuals(model, monitor: GradMonitor, scale: float = 1.0, fault: float = 1.0) -> dict:
    """The monitor's residuals of the step in hand, with `fault` x TENSOR's gradient (the
    gradients unscaled first, as the backends do)."""
    named = [(canonical_name(n), p.grad / scale) for n, p in model.named_parameters()]
    named = [(n, g * fault if n == TENSOR else g) for n, g in named]
    health = monitor.check(named, torch.tensor(2.0), 1.0, full=False, loss_scale=scale)
    return dict(zip(monitor.names, health.checksums, strict=True))


@pytest.mark.parametrize(
    ("style", "dtype", "checkpointing"),
    [
        ("gpt2", torch.float32, "none"),
        ("gpt2", torch.bfloat16, "block"),
        ("llama", torch.float32, "selective"),
        ("llama", torch.bfloat16, "none"),
    ],
)
def test_healthy_gradients_match_their_checksums_a_scaled_tensor_does_not(
    style, dtype, checkpointing
):
    """Every parameter is checked (the tied table from both its uses, norms, biases), under
    activation checkpointing too (a checkpointed norm's input from the recomputation).
    Rounding: FP32 below 1e-5, BF16 below 0.02 (measured 0.004: the inputs are BF16 on both
    sides, only the order and the rounding of the sums differ); x10 of one tensor is 0.9."""
    model = model_of(**(LLAMA if style == "llama" else {}))
    apply_activation_checkpointing(model, checkpointing)
    monitor = monitor_of(model)
    assert monitor.checksums.coverage.uncovered == []
    assert sorted(monitor.checksums.entries) == sorted(names_of(model))
    step(model, monitor, dtype, scale=1024.0)
    healthy = residuals(model, monitor, scale=1024.0)
    bound = 1e-5 if dtype == torch.float32 else 0.02
    assert max(healthy.values()) < bound and min(healthy.values()) >= 0.0
    faulty = residuals(model, monitor, scale=1024.0, fault=10.0)
    assert faulty[TENSOR] == pytest.approx(0.9, abs=bound)
    assert max(v for n, v in faulty.items() if n != TENSOR) < bound
    assert monitor.checksums.mismatches(list(faulty.values())) == [[TENSOR, faulty[TENSOR]]]
    assert monitor.checksums.mismatches(list(healthy.values())) == []


def test_the_expected_side_starts_at_zero_each_step_and_outside_the_steps_nothing_is_hooked():
    model = model_of()
    monitor = monitor_of(model, MonitorConfig(checksum=ChecksumConfig(until_step=3)))
    step(model, monitor)
    first = monitor.checksums.expected.clone()
    step(model, monitor)  # the same micro-batches again: the same sums, not twice them
    assert torch.allclose(monitor.checksums.expected, first, rtol=1e-6)
    assert monitor.checking and monitor.checksums.handles
    monitor.begin(4)  # past until_step: the hooks go, the step carries no check vectors
    assert not monitor.checking and not monitor.checksums.handles
    with torch.no_grad():  # an evaluation's forward adds nothing either
        monitor.begin(1)
        model(torch.zeros(1, SEQ, dtype=torch.long))
    assert not monitor.checksums.expected.any()
    health = monitor.check(
        [(canonical_name(n), torch.zeros_like(p)) for n, p in model.named_parameters()],
        torch.tensor(1.0),
        1.0,
        full=False,
    )
    assert health.checksums is not None and "checksum_observed" in monitor.slots(False, True)
    assert "checksum_observed" not in monitor.slots(False, False)


def test_a_dropped_tensor_is_no_longer_judged_and_nan_counts_as_a_mismatch():
    names = ["a", "b", "c"]
    assert mismatched(names, [0.5, float("nan"), 0.01], [0, 1, 2], 0.1)[1] == ["a", 0.5]
    assert mismatched(names, [0.5, 0.95, 0.01], [0, 1, 2], 0.1) == [["b", 0.95], ["a", 0.5]]
    model = model_of()
    monitor = monitor_of(model)
    step(model, monitor)
    faulty = residuals(model, monitor, fault=3.0)
    assert faulty[TENSOR] == pytest.approx(2 / 3, abs=1e-5)  # x3: (3 - 1) / 3
    monitor.stop_checking([TENSOR])
    assert monitor.checksums.mismatches(list(faulty.values())) == []


def test_layouts_whose_layers_see_part_of_the_work_are_not_checked_and_say_why():
    assert unsupported(Layout(world_size=1), "local", False) == ""
    assert unsupported(Layout(world_size=4, shard=2, replicate=2), "fsdp", False) == ""
    assert "parallel.backend=zero" in unsupported(Layout(world_size=2, shard=2), "zero", False)
    assert "tensor_parallel (2)" in unsupported(Layout(world_size=2, tp=2), "fsdp", False)
    assert "pipeline stages (2)" in unsupported(Layout(world_size=2, pp=2), "local", False)
    assert "parallel.compile" in unsupported(Layout(world_size=1), "local", True)


def test_an_moe_models_experts_and_routers_are_left_to_the_magnitude_tiers():
    model = model_of(moe=MoEConfig(experts=4, top_k=2))
    monitor = monitor_of(model)
    uncovered = monitor.checksums.coverage.uncovered
    assert uncovered and all(".moe." in n for n in uncovered)
    assert "blocks.0.attn.q.weight" in monitor.checksums.entries
    assert monitor.checksum_record() == {
        "checksums": len(names_of(model)) - len(uncovered),
        "unchecked": uncovered[:20],
    }
    step(model, monitor)
    healthy = residuals(model, monitor)
    assert max(healthy.values()) < 1e-5 and all(healthy[n] == 0.0 for n in uncovered)


def test_a_low_rank_gradient_orthogonal_to_one_probe_is_still_checked_to_its_rounding():
    """A layer whose input has one dominant direction has a gradient of rank about 1. Along a
    probe nearly orthogonal to that direction its check value is a tiny share of the gradient,
    and BF16 rounding of the gradient's own size becomes a large share of it (healthy tiny runs
    reached 0.1 with one probe); four probes keep the residual to the rounding of the whole."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False))
    monitor = monitor_of(model)
    first = monitor.checksums.probes[64][:, 0]
    direction = torch.randn(64)
    direction -= (direction @ first) / 64 * first  # orthogonal to the first probe
    x = torch.randn(512, 1) * direction + 1e-3 * torch.randn(512, 64)
    monitor.begin(1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(x)
    (y.float() * torch.randn(512, 32)).sum().backward()
    grad = model[0].weight.grad
    along_first = (grad @ first).norm() / (grad.norm() * 64**0.5)
    assert along_first < 0.01  # what one probe would have judged by
    health = monitor.check([("0.weight", grad)], torch.tensor(1.0), 1.0, full=False)
    assert health.checksums[0] < 0.02


def test_checksums_are_set_up_only_where_a_mismatch_can_be_acted_on():
    from types import SimpleNamespace

    from bigtrain.build import make_checksums
    from bigtrain.monitor.checksums import Coverage

    model = model_of()
    names = names_of(model)
    backend = SimpleNamespace(name="local", model=model)
    args = (backend, Layout(world_size=1), torch.device("cpu"), names, [1] * len(names))
    built = make_checksums(MonitorConfig(), *args, ModelConfig(), None)
    assert isinstance(built, GradChecksums) and len(built.entries) == len(names)
    off = make_checksums(MonitorConfig(), *args, ModelConfig(), None, replay=False)
    assert isinstance(off, Coverage) and "resilience.replay=false" in off.reason
    hf = make_checksums(MonitorConfig(), *args, ModelConfig(kind="hf"), None)
    assert off.record()["checksums"] == "off" and "model.kind=hf" in hf.reason
    disabled = MonitorConfig(checksum=ChecksumConfig(enabled=False))
    assert make_checksums(disabled, *args, ModelConfig(), None).reason.startswith("monitor.")
