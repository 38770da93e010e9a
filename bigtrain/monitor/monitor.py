"""The gradient-magnitude monitor: statistics, their reduction over ranks, detectors, one decision.

Each step after backward: one pass over this rank's gradient shards (stats.py), one SUM all-reduce
with the local loss packed in (plus a MAX all-reduce on full steps), one host read of the reduced
numbers; then the detectors, on identical numbers on every rank, take the same decision on every
rank. The global gradient norm for clipping is the square root of the summed squares: no second
pass over the gradients.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from bigtrain.config.schema import MonitorConfig
from bigtrain.monitor import kernel
from bigtrain.monitor.detectors import Spike, SpikeDetector
from bigtrain.monitor.stats import (
    GradStats,
    layer_stats,
    local_grad_stats,
    ranked,
    reduce_grad_stats,
    replica_differences,
    scale_stats,
    weighted_stats,
)

SPIKE_METRICS = ("loss", "grad_norm", "tensor_max")


@dataclass
class Anomaly:
    """What the monitor found wrong at one step, for the anomaly event and the rollback logic."""

    kind: str  # "nonfinite", "replica" (HSDP replicas disagree) or "spike"
    metric: str  # loss, grads, grad_norm, tensor_max, loss_scale_at_minimum, replicas
    value: float
    threshold: float | None = None
    baseline: float | None = None
    tensor: str | None = None  # the tensor that spiked (tensor_max), or the first non-finite one
    top_max_abs: list[list] = field(default_factory=list)  # [[name, max |g|], ...] largest first
    top_nonfinite: list[list] = field(default_factory=list)  # [[name, count], ...]
    spikes: list[dict[str, Any]] = field(default_factory=list)  # every detector that fired
    replicas: list[int] = field(default_factory=list)  # replicas whose gradients differ from 0's

    def details(self) -> dict[str, Any]:
        return {"type": self.kind, **{k: v for k, v in asdict(self).items() if k != "kind"}}


@dataclass
class Health:
    """The monitor's verdict on one step; device tensors plus the host values read once."""

    loss: torch.Tensor  # mean over ranks
    grad_norm: torch.Tensor  # global, unscaled, before clipping
    stats: GradStats  # reduced: identical on every rank
    host_loss: float
    host_grad_norm: float
    num_nonfinite: int
    overflow: bool  # FP16 overflow under dynamic loss scaling: skip and back off, not an anomaly
    anomaly: Anomaly | None
    skip: bool  # the optimizer step must not be applied
    telemetry: dict[str, Any]
    host_nonfinite: list[float]  # per tensor
    host_max_abs: list[float] | None  # per tensor, on full steps
    stop_requested: bool = False  # some rank got a preemption signal: all checkpoint and stop

    @property
    def finite(self) -> bool:
        return not self.overflow and not (self.anomaly and self.anomaly.kind == "nonfinite")


def weighted_count(value: float) -> int:
    """A reduced non-finite count: replicated tensors' counts were weighted 1/replication, so the
    sum is a float; a NaN on fewer than all replicas still counts (at least 1)."""
    return max(round(value), 1) if value > 0 else 0


class GradMonitor:
    def __init__(
        self,
        cfg: MonitorConfig,
        names: list[str],
        device: torch.device,
        use_kernel: bool,
        replication: list[int] | None = None,
        replica_group: dist.ProcessGroup | None = None,
    ) -> None:
        """`replication`: per tensor, over how many ranks its gradient is repeated (HSDP's
        replicas hold equal shards): its local statistics are weighted 1/replication before the
        SUM all-reduce, so a tensor counts once however many ranks repeat it. `replica_group`:
        this rank's HSDP replicas, compared on full steps (one more small collective)."""
        self.cfg, self.names, self.device, self.use_kernel = cfg, names, device, use_kernel
        self.replica_group = replica_group
        self.weights: torch.Tensor | None = None
        if replication is not None and any(r != 1 for r in replication):
            assert len(replication) == len(names), "one replication count per tensor"
            self.weights = 1.0 / torch.tensor(replication, dtype=torch.float32, device=device)
        self.stats_kernel = kernel.GradStatsKernel() if use_kernel else None
        self.last_local: torch.Tensor | None = None
        unknown = set(cfg.spikes) - set(SPIKE_METRICS)
        assert not unknown, f"validated by config.load: {unknown}"
        common = dict(
            window=cfg.window,
            method=cfg.detector,
            warmup=cfg.warmup,
            warmup_factor=cfg.warmup_factor,
        )
        self.detectors: dict[str, SpikeDetector] = {}
        for metric in cfg.spikes:
            if metric == "tensor_max":
                self.detectors[metric] = SpikeDetector(
                    metric,
                    names,
                    k=cfg.tensor_k,
                    min_factor=cfg.tensor_min_factor,
                    relative_floor=cfg.tensor_floor,
                    **common,
                )
            elif metric == "grad_norm":
                self.detectors[metric] = SpikeDetector(
                    metric, k=cfg.k, min_factor=cfg.min_factor, **common
                )
            else:
                self.detectors[metric] = SpikeDetector(metric, k=cfg.k, **common)

    def full_step(self, step: int, log_step: bool) -> bool:
        """Max |g| per tensor (per-tensor spikes, telemetry) every `monitor.every` steps and at log
        steps; other steps compute the sums of squares and non-finite counts only."""
        return log_step or (self.cfg.every > 0 and step % self.cfg.every == 0)

    def check(
        self,
        named_grads: list[tuple[str, torch.Tensor]],
        local_loss: torch.Tensor,
        grad_factor: float,
        full: bool,
        loss_scaled: bool,
        stop_requested: bool = False,
    ) -> Health:
        """`grad_factor`: the loss scale the gradients still carry (1.0 once unscaled).
        `loss_scaled`: FP16 dynamic loss scaling is on, so non-finite gradients under a finite
        loss are an overflow to back off from."""
        assert [n for n, _ in named_grads] == self.names, "gradients are aligned on every rank"
        stats = local_grad_stats(named_grads, self.device, full, self.use_kernel, self.stats_kernel)
        # This rank's own numbers, before the reduction: a replay compares them between its runs.
        self.last_local = torch.cat([stats.sum_sq, stats.nonfinite, local_loss.float().reshape(1)])
        flags = self._flags(stats, full, stop_requested)
        stats = weighted_stats(stats, self.weights)
        stats, loss, flags = reduce_grad_stats(stats, local_loss, flags)
        stats = scale_stats(stats, grad_factor)
        norm = stats.global_norm
        host_vectors = [stats.sum_sq, stats.nonfinite] + ([stats.max_abs] if full else [])
        # Expensive device-to-host synchronization: the step's decision, one read per step.
        host = torch.cat([loss.reshape(1), norm.reshape(1), flags, *host_vectors]).tolist()
        n, f = len(self.names), 2 + len(flags)
        host_loss, host_norm, stop = host[0], host[1], host[2] > 0
        replicas = [r for r, v in enumerate(host[3:f]) if v > 0]
        sum_sq, nonfinite = host[f : f + n], host[f + n : f + 2 * n]
        max_abs = host[f + 2 * n :] if full else None
        num_nonfinite = weighted_count(sum(nonfinite))
        loss_ok = host_loss == host_loss and abs(host_loss) != float("inf")
        grads_ok = num_nonfinite == 0 and host_norm < float("inf")

        overflow = loss_ok and not grads_ok and loss_scaled
        anomaly = None
        if not overflow:
            anomaly = self._verdict(
                loss_ok, grads_ok, host_loss, host_norm, num_nonfinite, max_abs, replicas
            )
        if anomaly is not None:
            if max_abs is None:  # the report names tensors by max |g|: compute it now (rare)
                return self.check(
                    named_grads, local_loss, grad_factor, True, loss_scaled, stop_requested
                )
            self._name_tensors(anomaly, max_abs, nonfinite)
        telemetry = {"grad_nonfinite": num_nonfinite}
        if max_abs is not None:
            layer_norm, layer_max = layer_stats(self.names, sum_sq, max_abs)
            telemetry.update(layer_grad_norm=layer_norm, layer_grad_max=layer_max)
        warn_only = anomaly is not None and anomaly.kind == "spike" and self.cfg.on_spike == "warn"
        skip = overflow or (anomaly is not None and not warn_only)
        return Health(
            loss,
            norm,
            stats,
            host_loss,
            host_norm,
            num_nonfinite,
            overflow,
            anomaly,
            skip,
            telemetry,
            nonfinite,
            max_abs,
            stop,
        )

    def _flags(self, stats: GradStats, full: bool, stop_requested: bool) -> torch.Tensor:
        """What rides along the SUM all-reduce: the preemption request, then on full steps under
        HSDP one difference flag per replica (the consistency probe)."""
        stop = torch.tensor([float(stop_requested)], device=self.device)
        if not full or self.replica_group is None:
            return stop
        local = torch.cat([stats.sum_sq, stats.nonfinite])
        return torch.cat([stop, replica_differences(local, self.replica_group)])

    def _verdict(
        self,
        loss_ok: bool,
        grads_ok: bool,
        host_loss: float,
        host_norm: float,
        num_nonfinite: int,
        max_abs: list[float] | None,
        replicas: list[int],
    ) -> Anomaly | None:
        """A non-finite loss or gradient, else replicas that disagree, else a spike; a healthy
        step feeds the detectors."""
        if not (loss_ok and grads_ok):
            metric = "loss" if not loss_ok else "grads" if num_nonfinite else "grad_norm"
            value = (
                host_loss if not loss_ok else float(num_nonfinite) if num_nonfinite else host_norm
            )
            return Anomaly("nonfinite", metric, value)
        if replicas:  # finite but inconsistent: the replicas' weights would drift apart
            return Anomaly("replica", "replicas", float(len(replicas)), replicas=replicas)
        spikes = self._spikes(host_loss, host_norm, max_abs)
        if spikes:
            first = spikes[0]
            return Anomaly(
                "spike",
                first.metric,
                first.value,
                first.threshold,
                first.baseline,
                first.tensor,
                spikes=[asdict(s) for s in spikes[: self.cfg.top_k]],
            )
        for metric, value in (("loss", host_loss), ("grad_norm", host_norm)):
            if metric in self.detectors:
                self.detectors[metric].add(value)
        if max_abs is not None and "tensor_max" in self.detectors:
            self.detectors["tensor_max"].add(max_abs)
        return None

    def _spikes(self, loss: float, norm: float, max_abs: list[float] | None) -> list[Spike]:
        """Every spike this step, in the order loss, global norm, tensors (largest ratio first)."""
        spikes: list[Spike] = []
        for metric, value in (("loss", loss), ("grad_norm", norm), ("tensor_max", max_abs)):
            if metric in self.detectors and value is not None:
                spikes += self.detectors[metric].check(value)
        return spikes

    def overflow_at_minimum(self, health: Health, scale: float) -> Anomaly:
        """An FP16 overflow at the minimum loss scale: an anomaly, not another halving."""
        anomaly = Anomaly("nonfinite", "loss_scale_at_minimum", scale)
        self._name_tensors(anomaly, health.host_max_abs, health.host_nonfinite)
        return anomaly

    def _name_tensors(
        self, anomaly: Anomaly, max_abs: list[float] | None, nonfinite: list[float]
    ) -> None:
        k = self.cfg.top_k
        anomaly.top_max_abs = ranked(self.names, max_abs, k) if max_abs is not None else []
        counts = ranked(self.names, nonfinite, k)
        anomaly.top_nonfinite = [[n, weighted_count(c)] for n, c in counts]
        if anomaly.tensor is None:
            top = anomaly.top_nonfinite or anomaly.top_max_abs
            anomaly.tensor = top[0][0] if top else None

    def state_dict(self) -> dict[str, Any]:
        return {metric: d.state_dict() for metric, d in self.detectors.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for metric, d in self.detectors.items():
            if metric in state:
                d.load_state_dict(state[metric])
