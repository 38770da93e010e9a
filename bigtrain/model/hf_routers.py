"""The routers of a transformers MoE family, watched like bigtrain's own MoE layers.

A family's model declares which module computes its router logits: transformers records them
for `output_router_logits` through `_can_record_outputs["router_logits"]` (the router's class
and the index of the logits in its output). bigtrain finds those routers by that class, next
to each experts module of the family's ep plan (model/hf_plans.py), and puts a `RouterProbe`
beside them (`router_probe` in the MoE block): a hook on the router keeps a training forward's
logits, a hook on the experts reads the experts each token was sent to, and the probe sums the
same numbers as bigtrain's MoE layers (model/moe.py's `record_routing`): load per expert, the
Switch load-balancing loss and the z-loss of the logits, the importance (mean softmax
probability) per expert and its spread. The monitor reduces them with the gradients and the
router rules read them (monitor/routers.py). Softmax probabilities whatever the family's own
score function (DeepSeek-V3 routes by sigmoid scores plus a correction): what the rules read is
whether the probability piles onto the experts that get the tokens, which softmax shows alike.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from bigtrain.model.hf_plans import family_experts
from bigtrain.model.moe import STATS_EXTRA, MoE, Routing, record_routing, recording
from bigtrain.utils.tensors import local_tensor

PROBE = "router_probe"
"""The probe's name in its MoE block (`hf.model.layers.1.mlp.router_probe`)."""


def declared_router(hf_model: nn.Module) -> Any | None:
    """transformers' recorder of the family's router logits (target_class, index); None when the
    family declares none."""
    for module in hf_model.modules():
        recorder = (getattr(type(module), "_can_record_outputs", None) or {}).get("router_logits")
        if recorder is not None and getattr(recorder, "target_class", None) is not None:
            return recorder
    return None


def router_modules(hf_model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The family's routers by type (declared_router's class), with their paths."""
    recorder = declared_router(hf_model)
    if recorder is None:
        return []
    return [(n, m) for n, m in hf_model.named_modules() if isinstance(m, recorder.target_class)]


class RouterProbe(nn.Module):
    """One MoE layer's routing, summed over a step's training forwards in bigtrain MoE's layout
    (`stats`, `extremes`: monitor/routers.py takes and clears them)."""

    def __init__(self, experts: int, index: int, router: str) -> None:
        """`router`: the router's name in the MoE block (`gate`)."""
        super().__init__()
        self.experts, self.index, self.router = experts, index, router
        self.register_buffer("stats", torch.zeros(2 * experts + STATS_EXTRA), persistent=False)
        self.register_buffer("extremes", torch.zeros(2 * experts), persistent=False)
        self._logits: torch.Tensor | None = None
        self.router_bias: torch.Tensor | None = None
        """Added to the router's logits when set (the `drill.router_bias` drill), through its
        input (`bias_input`)."""

    def bias_input(self, router: nn.Module, args: tuple) -> tuple | None:
        """The router's forward pre-hook for the drill: its input moved by pinv(W) @ bias, so
        that its logits x W^T come out raised by `router_bias` (exactly, the weight's rows being
        independent: fewer experts than features) while the family computes its own top-k. The
        experts get the layer's input unchanged."""
        if self.router_bias is None:
            return None
        weight = local_tensor(router.weight).detach().float()
        shift = torch.linalg.pinv(weight) @ self.router_bias.to(weight.device, torch.float32)
        return (args[0] + shift.to(args[0].dtype), *args[1:])

    def logits_seen(self, router: nn.Module, args: Any, output: Any) -> None:
        """The router's forward hook: its logits, when this forward is one that counts."""
        logits = output[self.index] if isinstance(output, (tuple, list)) else output
        self._logits = logits.detach() if recording(router) else None

    def choice_seen(self, experts: nn.Module, args: tuple, kwargs: dict) -> None:
        """The experts' forward pre-hook: (tokens, top-k expert ids, top-k weights)."""
        logits, self._logits = self._logits, None
        chosen = args[1] if len(args) > 1 else kwargs.get("top_k_index")
        if logits is not None and chosen is not None:
            record_routing(self.stats, self.extremes, observed(logits, chosen), 0)


def observed(logits: torch.Tensor, chosen: torch.Tensor) -> Routing:
    """The numbers bigtrain's MoE records, of a family's router logits (tokens, experts) and the
    experts it chose (tokens, k)."""
    logits = logits.float().reshape(-1, logits.shape[-1])
    n = logits.shape[-1]
    probs = logits.softmax(-1)
    load = torch.bincount(chosen.flatten(), minlength=n)
    importance = probs.mean(0)
    aux = n * (load.float() / chosen.numel() * importance).sum()
    z = torch.logsumexp(logits, dim=-1).square().mean()
    spread = probs.std(0, correction=0)
    return Routing(logits.new_empty(0), chosen, load, aux, z, importance, spread)


def attach_router_probes(hf_model: nn.Module) -> int:
    """A RouterProbe in each MoE block of a family that declares its routers and experts (none
    for a dense family); returns how many."""
    recorder = declared_router(hf_model)
    if recorder is None:
        return 0
    count = 0
    for name, experts, weights in family_experts(hf_model):
        block = hf_model.get_submodule(name.rpartition(".")[0])
        found = [(n, m) for n, m in block.named_children() if isinstance(m, recorder.target_class)]
        if not found or not weights or hasattr(block, PROBE):
            continue
        (router_name, router), *_ = found
        probe = RouterProbe(experts.get_parameter(weights[0]).shape[0], recorder.index, router_name)
        block.add_module(PROBE, probe)
        router.register_forward_pre_hook(probe.bias_input)
        router.register_forward_hook(probe.logits_seen)
        experts.register_forward_pre_hook(probe.choice_seen, with_kwargs=True)
        count += 1
    return count


def routing_layers(model: nn.Module) -> list[nn.Module]:
    """What records a model's routing (`stats`, `extremes`): bigtrain's MoE layers and a
    transformers family's router probes, in module order."""
    return [m for m in model.modules() if isinstance(m, (MoE, RouterProbe))]


def routed_experts_of(layer: nn.Module) -> int:
    """The experts a routing layer (routing_layers') chooses from."""
    return layer.cfg.experts if isinstance(layer, MoE) else layer.experts
