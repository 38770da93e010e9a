"""FP32 islands on a small module tree under CPU BF16 autocast: which modules the patterns keep in
FP32, what autocast does inside and after them, pattern errors, phase switches. In real runs on
the local and FSDP2 backends: tests/precision/test_engine.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bigtrain.errors import ConfigError
from bigtrain.precision.islands import FP32Islands

pytestmark = pytest.mark.unit


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn, self.mlp = nn.Module(), nn.Module()
        self.attn.qkv = nn.Linear(8, 8)
        self.mlp.up = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp.up(self.attn.qkv(x))


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.lm_head = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.lm_head(x)


class Wrapped(nn.Module):
    """Names as compile and DDP give them: `_orig_mod.module.lm_head`."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self._orig_mod = nn.Module()
        self._orig_mod.module = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._orig_mod.module(x)


def linears(model: nn.Module) -> dict[str, nn.Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def forward_seen(model: nn.Module, x: torch.Tensor) -> dict[str, tuple]:
    """Run `model` under CPU BF16 autocast; per Linear: (autocast on inside it, its input's
    dtype, its output's dtype). Hooks registered after the islands', so they see what the
    Linear computes with."""
    seen: dict[str, list] = {}
    handles = []
    for name, m in linears(model).items():

        def before(module, args, name=name):
            seen[name] = [torch.is_autocast_enabled("cpu"), args[0].dtype]

        def after(module, args, output, name=name):
            seen[name].append(output.dtype)

        handles += [m.register_forward_pre_hook(before), m.register_forward_hook(after)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x)
        assert torch.is_autocast_enabled("cpu")  # restored after the last island
    for h in handles:
        h.remove()
    return {name: tuple(v) for name, v in seen.items()}


ISLAND = (False, torch.float32, torch.float32)  # autocast off, FP32 in, FP32 out
BF16 = (True, torch.bfloat16, torch.bfloat16)  # autocast on, a BF16 input, BF16 out
BF16_FROM_FP32 = (True, torch.float32, torch.bfloat16)  # after an island: autocast casts down


def test_patterns_pick_modules_by_canonical_name():
    model = Tiny()
    islands = FP32Islands(model, "cpu")
    islands.set(("lm_head", "*.attn.qkv"))
    assert islands.names == ["blocks.0.attn.qkv", "blocks.1.attn.qkv", "lm_head"]
    wrapped = FP32Islands(Wrapped(Tiny()), "cpu")
    wrapped.set(("lm_head", "blocks.1.*"))
    # `blocks.1.*` matches blocks.1's descendants, not blocks.1; the outermost are hooked.
    assert wrapped.names == ["blocks.1.attn", "blocks.1.mlp", "lm_head"]


def test_islands_run_in_fp32_and_autocast_resumes_after_them():
    torch.manual_seed(0)
    model = Tiny()
    FP32Islands(model, "cpu").set(("lm_head", "*.attn.qkv"))
    seen = forward_seen(model, torch.randn(2, 8))
    assert seen == {
        "blocks.0.attn.qkv": ISLAND,
        "blocks.0.mlp.up": BF16_FROM_FP32,
        "blocks.1.attn.qkv": ISLAND,  # its BF16 input was cast up
        "blocks.1.mlp.up": BF16_FROM_FP32,
        "lm_head": ISLAND,
    }


def test_an_island_computes_exactly_what_fp32_computes():
    torch.manual_seed(0)
    model = Tiny()
    FP32Islands(model, "cpu").set(("lm_head",))
    x = torch.randn(2, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = model.blocks[1](model.blocks[0](x))
        out = model.lm_head(hidden)
    assert hidden.dtype == torch.bfloat16
    reference = F.linear(hidden.float(), model.lm_head.weight, model.lm_head.bias)
    assert out.dtype == torch.float32 and torch.equal(out, reference)


def test_only_the_outermost_match_is_hooked_and_its_children_run_in_fp32():
    model = Tiny()
    islands = FP32Islands(model, "cpu")
    islands.set(("blocks.0", "blocks.0.attn.qkv"))
    assert islands.names == ["blocks.0"] and len(islands._handles) == 2
    seen = forward_seen(model, torch.randn(2, 8))
    assert seen["blocks.0.attn.qkv"] == seen["blocks.0.mlp.up"] == ISLAND
    assert seen["blocks.1.attn.qkv"] == BF16_FROM_FP32 and seen["lm_head"] == BF16


@pytest.mark.parametrize("pattern", ["blocks.2.*", "qkv", "LM_HEAD", "lm_head.weight"])
def test_a_pattern_that_matches_no_module_is_a_config_error(pattern):
    """Whole canonical module names, case-sensitive; parameters are not modules."""
    islands = FP32Islands(Tiny(), "cpu")
    message = f"precision.fp32_modules: pattern '{pattern}' matches no module of the model"
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("*", r"\*")):
        islands.set(("lm_head", pattern))


def test_a_new_phase_replaces_the_islands_and_an_empty_one_removes_them():
    model = Tiny()
    islands = FP32Islands(model, "cpu")
    islands.set(("lm_head",))
    islands.set(("lm_head",))  # the same phase again: no second set of hooks
    assert len(islands._handles) == 2
    islands.set(("blocks.1.attn.qkv",))
    seen = forward_seen(model, torch.randn(2, 8))
    assert seen["blocks.1.attn.qkv"] == ISLAND and seen["lm_head"] == BF16
    islands.set(())
    assert islands.names == [] and islands._handles == []
    assert set(forward_seen(model, torch.randn(2, 8)).values()) == {
        (True, torch.float32, torch.bfloat16),  # the first Linear gets the FP32 input
        BF16,
    }


def test_an_error_inside_an_island_still_restores_autocast():
    class Boom(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("boom")

    model = Tiny()
    model.lm_head = Boom()
    FP32Islands(model, "cpu").set(("lm_head",))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(RuntimeError, match="boom"):
            model(torch.randn(2, 8))
        assert torch.is_autocast_enabled("cpu")
        assert model.blocks[0].attn.qkv(torch.randn(2, 8)).dtype == torch.bfloat16
    assert model.lm_head._bigtrain_fp32_ctx == []


def test_a_rejected_set_leaves_the_islands_as_they_were():
    model = Tiny()
    islands = FP32Islands(model, "cpu")
    islands.set(("lm_head",))
    with pytest.raises(ConfigError):
        islands.set(("lm_head", "nope"))
    assert forward_seen(model, torch.randn(2, 8))["lm_head"] == ISLAND
    with pytest.raises(ConfigError):
        islands.set(("lm_head", "nope"))  # asked again: still wrong
