"""FP32 islands: modules chosen by name pattern run entirely in FP32 under autocast.

Hooks applied from outside the model: before a matching module runs, autocast is switched off and
its floating inputs are cast to FP32; after it, autocast is restored. The set of patterns can
change between precision phases.

A transformers MoE family's routers are islands in every phase, found by type (the router class
the family declares: model/hf_routers.py), as bigtrain's own MoE router is one by construction:
their logits choose the experts, and low-precision logits tie and flip choices.
"""

from __future__ import annotations

import fnmatch

import torch
from torch import nn

from bigtrain.errors import ConfigError
from bigtrain.model.hf import HFCausalLM
from bigtrain.model.hf_routers import router_modules
from bigtrain.utils.names import canonical_name


def matching_modules(model: nn.Module, patterns: tuple[str, ...]) -> list[tuple[str, nn.Module]]:
    out = []
    for name, module in model.named_modules():
        cname = canonical_name(name)
        if cname and any(fnmatch.fnmatchcase(cname, p) for p in patterns):
            out.append((cname, module))
    return out


class FP32Islands:
    def __init__(self, model: nn.Module, device_type: str, whole: nn.Module | None = None) -> None:
        """`whole`: the model whose modules a pattern must match somewhere (a pipeline stage
        holds only its part of it); `model` by default."""
        self.model, self.device_type = model, device_type
        self.whole = whole if whole is not None else model
        self.patterns: tuple[str, ...] | None = None
        self.names: list[str] = []
        self._handles: list = []
        self.routers = [
            (canonical_name(f"{path}.hf.{n}" if path else f"hf.{n}"), m)
            for path, owner in model.named_modules()
            if isinstance(owner, HFCausalLM)  # the model, or a pipeline rank's stages
            for n, m in router_modules(owner.hf)
        ]
        """A transformers MoE family's routers: islands in every phase (module docstring)."""

    def set(self, patterns: tuple[str, ...]) -> None:
        if patterns == self.patterns:
            return
        matched = self.check(patterns)  # before anything changes: a rejected set changes nothing
        matched += [(n, m) for n, m in self.routers if all(m is not o for _, o in matched)]
        for handle in self._handles:
            handle.remove()
        self._handles, self.patterns = [], patterns
        # Only the outermost matches get hooks: their children run inside the FP32 context.
        outer = [
            (n, m)
            for n, m in matched
            if not any(n.startswith(o + ".") for o, _ in matched if o != n)
        ]
        self.names = [n for n, _ in outer]
        for _, module in outer:
            self._handles.append(module.register_forward_pre_hook(self._enter, with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._exit, always_call=True))

    def check(self, patterns: tuple[str, ...]) -> list[tuple[str, nn.Module]]:
        """The modules `patterns` match; ConfigError for a pattern that matches none."""
        matched = matching_modules(self.model, patterns)
        known = matched if self.whole is self.model else matching_modules(self.whole, patterns)
        for pattern in patterns:
            if not any(fnmatch.fnmatchcase(name, pattern) for name, _ in known):
                raise ConfigError(
                    f"precision.fp32_modules: pattern '{pattern}' matches no module of the model"
                )
        return matched

    def _enter(self, module, args, kwargs):
        ctx = torch.autocast(self.device_type, enabled=False)
        ctx.__enter__()
        module._bigtrain_fp32_ctx = getattr(module, "_bigtrain_fp32_ctx", []) + [ctx]

        def up(x):
            return x.float() if torch.is_tensor(x) and x.is_floating_point() else x

        return tuple(up(a) for a in args), {k: up(v) for k, v in kwargs.items()}

    def _exit(self, module, args, output):
        module._bigtrain_fp32_ctx.pop().__exit__(None, None, None)
