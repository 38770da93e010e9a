"""What is wrong with a step, if anything: the verdict on the monitor's reduced numbers.

In this order: a non-finite loss or gradient (an FP16 overflow when loss scaling is on and the loss
is finite: skip and back off, not an anomaly), HSDP replicas that disagree, then the spike rules
(rules.py) that `monitor.rules` switches on. A healthy step feeds the rules' windows and the
per-tensor history that names culprits. Identical numbers on every rank give the same verdict on
every rank, with no further agreement round.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from bigtrain.config.schema import MonitorConfig
from bigtrain.model.gpt import GradientRoles
from bigtrain.monitor.monitor import Health, weighted_count
from bigtrain.monitor.routers import (
    AUX_LOSS_MAX,
    LAYER_AUX_LOSS,
    LAYER_ROUTER_SPREAD,
    LAYER_Z_LOSS,
    ROUTER_SPREAD,
    Z_LOSS_MAX,
    router_weight,
)
from bigtrain.monitor.stats import ranked
from bigtrain.resilience.rules import SpikeRule, TensorHistory
from bigtrain.resilience.suspicion import Suspicion


@dataclass
class Anomaly:
    """What was found wrong at one step, for the anomaly event and the ladder."""

    kind: str  # "nonfinite", "replica" (HSDP replicas disagree) or "spike"
    metric: str  # loss, grads, grad_norm, loss_scale_at_minimum, replicas
    value: float
    threshold: float | None = None
    baseline: float | None = None
    tensor: str | None = None  # the tensor that jumped most, or the first non-finite one
    top_jumps: list[list] = field(default_factory=list)  # [[name, norm / its baseline], ...]
    top_max_abs: list[list] = field(default_factory=list)  # [[name, max |g|], ...] largest first
    top_nonfinite: list[list] = field(default_factory=list)  # [[name, count], ...]
    spikes: list[dict[str, Any]] = field(default_factory=list)  # every rule that fired
    replicas: list[int] = field(default_factory=list)  # replicas whose gradients differ from 0's

    def details(self) -> dict[str, Any]:
        return {"type": self.kind, **{k: v for k, v in asdict(self).items() if k != "kind"}}


@dataclass
class Verdict:
    anomaly: Anomaly | None = None
    overflow: bool = False
    """FP16 overflow under dynamic loss scaling: skipped and backed off, not an anomaly."""
    warn_only: bool = False
    """A spike with monitor.on_spike=warn: reported, and the step is applied anyway."""

    @property
    def skip(self) -> bool:
        """The optimizer step must not be applied."""
        return self.overflow or (self.anomaly is not None and not self.warn_only)

    @property
    def finite(self) -> bool:
        return not self.overflow and not (self.anomaly and self.anomaly.kind == "nonfinite")


ROUTER_SERIES = {
    "router_collapse": LAYER_AUX_LOSS,
    "router_logits": LAYER_Z_LOSS,
    "router_spread": LAYER_ROUTER_SPREAD,
}
"""Per MoE block, the series a router rule's worst-layer value comes from."""
ROUTER_VALUES = {
    "router_collapse": AUX_LOSS_MAX,
    "router_logits": Z_LOSS_MAX,
    "router_spread": ROUTER_SPREAD,
}
"""The telemetry a router rule reads: its worst layer's value (monitor/routers.py)."""


def _router_of(metric: str, telemetry: dict[str, Any]) -> str | None:
    """A router rule's culprit: the router weight of the block whose value it read (None for
    the other rules: the per-tensor jumps name theirs)."""
    by_block = telemetry.get(ROUTER_SERIES.get(metric, ""), {})
    return router_weight(max(by_block, key=by_block.get)) if by_block else None


class Detector:
    def __init__(
        self, cfg: MonitorConfig, names: list[str], roles: GradientRoles = GradientRoles()
    ) -> None:
        """`roles`: what the suspicion tier knows of the gradients (suspicion.py)."""
        self.cfg, self.names = cfg, names
        self.rules = {
            metric: SpikeRule(metric, r.window, r.factor, r.sigmas, r.min_values)
            for metric in cfg.rules
            for r in [getattr(cfg, metric)]
        }
        self.tensors = TensorHistory(names, cfg.tensor_window)
        self.suspicion = Suspicion(cfg.suspicion, names, roles)

    def suspects(self, health: Health) -> list[list]:
        """The suspicion tier (suspicion.py): [name, jump] of the tensors whose shards jumped."""
        return self.suspicion.check(health.shards)

    def verdict(self, health: Health, loss_scaled: bool) -> Verdict:
        """`loss_scaled`: FP16 dynamic loss scaling is on, so non-finite gradients under a finite
        loss are an overflow to back off from. The windows are unchanged (see `add`)."""
        if health.loss_finite and not health.grads_finite and loss_scaled:
            return Verdict(overflow=True)
        anomaly = self._anomaly(health)
        if anomaly is None:
            return Verdict()
        return Verdict(anomaly, warn_only=anomaly.kind == "spike" and self.cfg.on_spike == "warn")

    def _anomaly(self, health: Health) -> Anomaly | None:
        if not (health.loss_finite and health.grads_finite):
            if not health.loss_finite:
                return Anomaly("nonfinite", "loss", health.host_loss)
            if health.num_nonfinite:
                return Anomaly("nonfinite", "grads", float(health.num_nonfinite))
            return Anomaly("nonfinite", "grad_norm", health.host_grad_norm)
        if health.replicas:  # finite but inconsistent: the replicas' weights would drift apart
            return Anomaly(
                "replica", "replicas", float(len(health.replicas)), replicas=health.replicas
            )
        values = self._values(health)
        spikes = [
            s
            for m, rule in self.rules.items()
            if m in values and (s := rule.check(values[m])) is not None
        ]
        if not spikes:
            return None
        first = max(spikes, key=lambda s: s.ratio)
        return Anomaly(
            "spike",
            first.metric,
            first.value,
            first.threshold,
            first.baseline,
            tensor=_router_of(first.metric, health.telemetry),
            spikes=[asdict(s) for s in spikes],
        )

    def add(self, health: Health) -> None:
        """A healthy step's values join the windows."""
        values = self._values(health)
        for metric, rule in self.rules.items():
            if metric in values:
                rule.add(values[metric])
        self.tensors.add(health.host_sum_sq)
        self.suspicion.add(health.shards)

    @staticmethod
    def _values(health: Health) -> dict[str, float]:
        """The series the rules watch; the router ones only for an MoE model's steps."""
        values = {"loss": health.host_loss, "grad_norm": health.host_grad_norm}
        for rule, key in ROUTER_VALUES.items():
            if key in health.telemetry:
                values[rule] = health.telemetry[key]
        return values

    def name_tensors(self, anomaly: Anomaly, health: Health, max_abs: list[float] | None) -> None:
        """The report's culprits: tensors by their jump over their own history, by max |g| and
        by non-finite count."""
        k = self.cfg.top_k
        anomaly.top_jumps = self.tensors.jumps(health.host_sum_sq, k)
        anomaly.top_max_abs = ranked(self.names, max_abs, k) if max_abs is not None else []
        counts = ranked(self.names, health.host_nonfinite, k)
        anomaly.top_nonfinite = [[n, weighted_count(c)] for n, c in counts]
        if anomaly.tensor is None:
            top = anomaly.top_nonfinite or anomaly.top_jumps or anomaly.top_max_abs
            anomaly.tensor = top[0][0] if top else None

    def overflow_at_minimum(self, scale: float) -> Anomaly:
        """An FP16 overflow at the minimum loss scale: an anomaly, not another halving."""
        return Anomaly("nonfinite", "loss_scale_at_minimum", scale)

    def state_dict(self) -> dict[str, Any]:
        return {
            "rules": {m: rule.state_dict() for m, rule in self.rules.items()},
            "tensors": self.tensors.state_dict(),
            "suspicion": self.suspicion.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Windows of the rules this run has; a checkpoint of an earlier bigtrain (other rules)
        leaves them empty, as at the start."""
        for metric, rule in self.rules.items():
            rule.load_state_dict(state.get("rules", {}).get(metric, {"values": []}))
        self.tensors.load_state_dict(state.get("tensors", {}))
        self.suspicion.load_state_dict(state.get("suspicion", {}))
