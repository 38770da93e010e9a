"""The routed experts of a model, whichever kind: bigtrain's MoE blocks (model/moe.py) or the
experts a transformers MoE family declares in its ep plan (model/hf_plans.py). The one list that
the parameter counts (total against active per token), the FLOPs per token and the planner's
expert-parallel shares are computed from."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from bigtrain.model.hf_plans import experts_per_token, family_experts
from bigtrain.model.moe import MoE


@dataclass(frozen=True)
class RoutedExperts:
    """One MoE layer's routed experts: stacked weights of `experts` experts, `top_k` per token."""

    module: nn.Module
    weights: tuple[str, ...]
    experts: int
    top_k: int

    @property
    def params(self) -> int:
        """Parameters of all its experts (whole, also where they are sharded)."""
        return sum(self.module.get_parameter(w).numel() for w in self.weights)

    @property
    def active(self) -> int:
        """Of them, those one token goes through."""
        return self.params * self.top_k // self.experts


def routed_experts(model: nn.Module) -> list[RoutedExperts]:
    """The model's routed experts in module order (bigtrain's GPT or a pipeline chunk of it, or
    a transformers model behind bigtrain's wrapper); empty for a dense model."""
    hf = getattr(model, "hf", None)
    if isinstance(hf, nn.Module):
        found = family_experts(hf)
        top_k = experts_per_token(hf) if found else 0
        return [
            RoutedExperts(m, tuple(w), m.get_parameter(w[0]).shape[0], top_k)
            for _, m, w in found
            if w
        ]
    return [
        RoutedExperts(
            layer.experts,
            tuple(n for n, _ in layer.experts.named_parameters(recurse=False)),
            layer.cfg.experts,
            layer.cfg.top_k,
        )
        for layer in model.modules()
        if isinstance(layer, MoE)
    ]
