"""The routers of a mixture-of-experts model, watched per step (docs/moe.md).

Each MoE layer sums over the step's training forwards the token-expert pairs routed to each of its
experts, its load-balancing loss, its z-loss, the pairs a capacity dropped, and how many forwards
it ran (model/moe.py); a transformers MoE family's router probes sum the same numbers
(model/hf_routers.py). `RouterStats.take` lays those of the whole model out in one vector, the same
layout on every rank (zeros for the layers this rank does not hold: pipeline stages), which rides
along the monitor's SUM all-reduce; `read` turns the reduced numbers into the step's router
metrics, identical on every rank, which the detection rules read: `router_collapse` the worst
layer's load-balancing loss (it grows when the router's probabilities pile onto the experts that
get the tokens), `router_logits` the worst layer's z-loss (the squared log-sum-exp of the logits),
`router_spread` the worst layer's spread of the experts' importance over the step's forwards.

The spread compares the forwards of one step, which ran the same router weights on samples of
the same data: each expert's importance (its mean score over a forward's tokens, the
probabilities the balancing loss reads) agrees between them up to sampling noise. A rank whose
routers compute something else (a faulty device, the `drill.router_bias` drill) stands out
however many healthy ranks there are, where the averaged losses dilute it. Each layer keeps the
largest importance per expert over its forwards and 1 - the smallest (`extremes`); they ride a
MAX all-reduce (the monitor's max |g| one), and the spread is the widest max - min of an expert:
a probability, 0 when every forward agrees.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from bigtrain.errors import ConfigError
from bigtrain.model.hf_routers import routing_layers
from bigtrain.model.moe import STATS_EXTRA
from bigtrain.monitor.slots import HostValues, Slot
from bigtrain.utils.names import canonical_name

ROUTER_SUMS, ROUTER_EXTREMES = "router_sums", "router_extremes"
"""The slots of `RouterStats.take`'s sums (summed over ranks) and extremes (maxed)."""

# The step's router metrics (`RouterStats.read`): the model's worst layer or mean over layers ...
LOAD_MAX_MEAN = "moe_load_max_mean"
LOAD_ENTROPY = "moe_load_entropy"
AUX_LOSS = "moe_aux_loss"
Z_LOSS = "moe_z_loss"
AUX_LOSS_MAX = "moe_aux_loss_max"
Z_LOSS_MAX = "moe_z_loss_max"
ROUTER_SPREAD = "moe_router_spread"
DROPPED = "moe_dropped"
# ... and per MoE block ({block: value}).
LAYER_LOAD_MAX_MEAN = "moe_layer_load_max_mean"
LAYER_AUX_LOSS = "moe_layer_aux_loss"
LAYER_Z_LOSS = "moe_layer_z_loss"
LAYER_ROUTER_SPREAD = "moe_layer_router_spread"
LAYER_LOAD = "moe_layer_load"


def block_of(name: str) -> str:
    """`blocks.3.moe` -> `blocks.3`: the block a router belongs to."""
    return name.rsplit(".", 1)[0]


def layer_name(name: str, layer: nn.Module) -> str:
    """What a routing layer's metrics are named by: bigtrain's MoE by its block (`blocks.3`), a
    transformers family's probe (`hf.model.layers.1.mlp.router_probe`) by its router's own
    name (`hf.model.layers.1.mlp.gate`)."""
    router = getattr(layer, "router", None)
    return f"{block_of(name)}.{router}" if isinstance(router, str) else block_of(name)


def router_weight(layer: str) -> str:
    """The router weight of a layer named by `layer_name`: the culprit a router rule names."""
    return f"{layer}.moe.router.weight" if layer.startswith("blocks.") else f"{layer}.weight"


def router_layers(modules: list[nn.Module]) -> dict[str, nn.Module]:
    """The MoE layers (bigtrain's) and router probes (a transformers family's) in `modules`, by
    the name of the block each belongs to."""
    records = {id(m) for module in modules for m in routing_layers(module)}
    return {
        layer_name(canonical_name(name), sub): sub
        for module in modules
        for name, sub in module.named_modules()
        if id(sub) in records
    }


def natural_key(name: str) -> tuple:
    """`layers.10` after `layers.9`."""
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in name.split("."))


def spread(
    top: list[float], one_minus_low: list[float], std: list[float], forwards: float
) -> float:
    """The widest range of an expert's importance over the forwards, in units of the score's
    mean standard deviation over a forward's tokens (at least 0.0)."""
    ranges = [max(hi + lo - 1.0, 0.0) for hi, lo in zip(top, one_minus_low, strict=True)]
    return max(r / (s / forwards) if s > 0 else 0.0 for r, s in zip(ranges, std, strict=True))


class RouterStats:
    def __init__(self, layers: dict[str, nn.Module], names: list[str], experts: int) -> None:
        """`layers`: this rank's MoE layers by block name; `names`: every MoE block of the whole
        model, in order (the vector's layout)."""
        self.layers, self.names, self.experts = layers, names, experts
        self.width = 2 * experts + STATS_EXTRA

    @classmethod
    def of(cls, modules: list[nn.Module], names: list[str], experts: int) -> RouterStats | None:
        """Over the MoE layers found in `modules` (a model, or a pipeline rank's chunks); None for
        a dense model."""
        if not names:
            return None
        return cls(router_layers(modules), names, experts)

    @classmethod
    def of_family(cls, modules: list[nn.Module], gather: bool) -> RouterStats | None:
        """Over the router probes of a transformers MoE family (model/hf_routers.py), named by
        the family's routers (`hf.model.layers.1.mlp.gate`); None for a dense family. `gather`:
        this rank holds some of the layers only (pipeline stages): every rank's names are
        gathered (a collective) so that the layout is the whole model's on every rank."""
        layers = router_layers(modules)
        held = [(name, layer.experts) for name, layer in layers.items()]
        if gather:
            every: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(every, held)
            held = sorted({x for rank in every for x in rank}, key=lambda x: natural_key(x[0]))
        if not held:
            return None
        counts = {experts for _, experts in held}
        if len(counts) != 1:
            raise ConfigError(
                f"the MoE layers of this transformers model have different numbers of experts "
                f"({sorted(counts)}): bigtrain's router telemetry needs one"
            )
        return cls(layers, [name for name, _ in held], counts.pop())

    @property
    def size(self) -> int:
        return len(self.names) * self.width

    def slots(self) -> list[Slot]:
        """What `take` yields: the sums of every layer, then their extremes."""
        extremes = len(self.names) * 2 * self.experts
        return [Slot(ROUTER_SUMS, self.size, "sum"), Slot(ROUTER_EXTREMES, extremes, "max")]

    def take(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The step's sums (for a SUM) and extremes (for a MAX) of every MoE layer held here
        (zeros elsewhere: neutral in both), and the layers' records cleared for the next step
        (or the step's replay)."""
        sums, extremes = [], []
        for name in self.names:
            layer = self.layers.get(name)
            if layer is None:
                sums.append(torch.zeros(self.width, device=device))
                extremes.append(torch.zeros(2 * self.experts, device=device))
            else:
                sums.append(layer.stats.to(device, copy=True))
                extremes.append(layer.extremes.to(device, copy=True))
                layer.stats.zero_()
                layer.extremes.zero_()
        return {ROUTER_SUMS: torch.cat(sums), ROUTER_EXTREMES: torch.cat(extremes)}

    def read(self, values: HostValues) -> dict[str, Any]:
        """The router metrics of the reduced sums (over every rank and micro-batch): per layer the
        busiest expert's load over the mean (1.0: balanced; experts / top_k: every token sends
        the same experts), the entropy of the load over log(experts) (1.0: balanced), the mean
        load-balancing and z-losses; the model's worst layer's ratio, entropy and losses, the
        mean losses over layers and the dropped pairs; per layer and worst the importance's
        spread over the forwards (module docstring) from the MAX-reduced `extremes`."""
        host, extremes = values[ROUTER_SUMS], values[ROUTER_EXTREMES]
        n = self.experts
        by_layer: dict[str, dict[str, float]] = {}
        dropped = 0.0
        for i, name in enumerate(self.names):
            row = host[i * self.width : (i + 1) * self.width]
            load, (aux, z, drop, forwards), std = row[:n], row[n : n + 4], row[n + 4 :]
            total = sum(load)
            if forwards <= 0 or total <= 0:
                continue
            ends = extremes[i * 2 * n : (i + 1) * 2 * n]  # max, 1 - min per expert
            shares = [x / total for x in load]
            entropy = -sum(s * math.log(s) for s in shares if s > 0) / math.log(n)
            by_layer[name] = {
                "max_mean": max(shares) * n,
                "entropy": entropy,
                "aux": aux / forwards,
                "z": z / forwards,
                "spread": spread(ends[:n], ends[n:], std, forwards) if forwards > 1 else 0.0,
                "load": [round(s, 4) for s in shares],
            }
            dropped += drop
        if not by_layer:
            return {}
        layers = list(by_layer.values())
        return {
            LOAD_MAX_MEAN: max(v["max_mean"] for v in layers),
            LOAD_ENTROPY: min(v["entropy"] for v in layers),
            AUX_LOSS: sum(v["aux"] for v in layers) / len(layers),
            Z_LOSS: sum(v["z"] for v in layers) / len(layers),
            AUX_LOSS_MAX: max(v["aux"] for v in layers),
            Z_LOSS_MAX: max(v["z"] for v in layers),
            ROUTER_SPREAD: max(v["spread"] for v in layers),
            DROPPED: dropped,
            LAYER_LOAD_MAX_MEAN: {k: v["max_mean"] for k, v in by_layer.items()},
            LAYER_AUX_LOSS: {k: v["aux"] for k, v in by_layer.items()},
            LAYER_Z_LOSS: {k: v["z"] for k, v in by_layer.items()},
            LAYER_ROUTER_SPREAD: {k: v["spread"] for k, v in by_layer.items()},
            LAYER_LOAD: {k: v["load"] for k, v in by_layer.items()},
        }
