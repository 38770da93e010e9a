"""The gradient-magnitude monitor: statistics and their reduction over ranks, read once per step.

Each step after backward: one pass over this rank's gradient shards (stats.py), one SUM all-reduce
with the local loss packed in, one MAX all-reduce (max |g| on full steps; every step, the
suspicion tier's shard statistics (shards.py) and an MoE model's router extremes), one host read
of the reduced numbers. What rides along travels in named slots (slots.py), declared per kind of
step (`GradMonitor.slots`) and read by name. Every rank then holds the same numbers, so the
detection rules (bigtrain/resilience) reach the same verdict on every rank. The global gradient
norm for clipping is the square root of the summed squares: no second pass over the gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from bigtrain.config.schema import MonitorConfig
from bigtrain.monitor.checksums import Coverage, GradChecksums
from bigtrain.monitor.shards import SHARDS, ShardHistory, shard_levels, shard_slot
from bigtrain.monitor.slots import HostValues, Pack, Slot, SlotLayout
from bigtrain.monitor.stats import (
    LOSS,
    MAX_ABS,
    NONFINITE,
    SUM_SQ,
    GradStats,
    grad_slots,
    layer_stats,
    local_grad_stats,
    packed_stats,
    reduce_grad_stats,
    replica_differences,
    scale_stats,
    stats_values,
    weighted_stats,
)
from bigtrain.parallel.layout import Layout

STOP, REPLICAS, GRAD_NORM, CHECKSUMS = "stop", "replicas", "grad_norm", "checksums"
"""The preemption request's slot, the HSDP probe's (full steps), the norm's host value and the
checksums' residuals (host value, checked steps)."""

AcrossGroups = Callable[
    [torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]],
    tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]],
]
"""(loss, summed, maxed) -> the same reduced over fault-tolerant replica groups (by name)."""


class Rider(Protocol):
    """Numbers of a part of the model that ride along the step's collectives: an MoE model's
    routers (routers.py), the FP8 layers' statistics (fp8.py). Its slots are reduced over every
    rank and every live replica group by their kinds, inside the step (before a group commits),
    and read back in the monitor's one host read."""

    def slots(self) -> list[Slot]:
        """The slots `take` fills: the same on every step and every rank."""
        ...

    def take(self, device: torch.device) -> dict[str, torch.Tensor]:
        """This rank's values of the run of the step just computed, by slot name."""
        ...

    def read(self, host: HostValues) -> dict[str, Any]:
        """The reduced values, identical on every rank: the step's telemetry from them."""
        ...


@dataclass
class Health:
    """The monitor's numbers of one step: device tensors plus the host values read once."""

    loss: torch.Tensor  # mean over ranks
    grad_norm: torch.Tensor  # global, unscaled, before clipping
    stats: GradStats  # reduced: identical on every rank
    host_loss: float
    host_grad_norm: float
    num_nonfinite: int
    host_sum_sq: list[float]  # per tensor (unscaled)
    host_nonfinite: list[float]  # per tensor
    host_max_abs: list[float] | None  # per tensor, on full steps
    replicas: list[int]  # HSDP replicas whose gradient shards differ from replica 0's (full steps)
    telemetry: dict[str, Any]
    stop_requested: bool = False  # some rank got a preemption signal: all checkpoint and stop
    shards: list[float] | None = None
    """With the suspicion tier, per tensor over the ranks (shards.py): the largest rise of a
    shard, the negated smallest, the largest rise beyond its rank's median, the largest rise
    beyond its partner's (EMPTY: unknown)."""
    grad_factor: float = 1.0  # the loss scale the gradients still carried
    levels: torch.Tensor | None = None
    """With the suspicion tier: this rank's shard levels, kept in its history if the step is."""
    checksums: list[float] | None = None
    """On checked steps (checksums.py), per tensor its check vectors' residual (0: unchecked)."""

    @property
    def loss_finite(self) -> bool:
        return self.host_loss == self.host_loss and abs(self.host_loss) != float("inf")

    @property
    def grads_finite(self) -> bool:
        return self.num_nonfinite == 0 and self.host_grad_norm < float("inf")


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
        layout: Layout | None = None,
        across_groups: AcrossGroups | None = None,
        riders: Sequence[Rider] = (),
        checksums: GradChecksums | Coverage | None = None,
    ) -> None:
        """`replication`: per tensor, over how many ranks its gradient is repeated (HSDP's
        replicas hold equal shards): its local statistics are weighted 1/replication before the
        SUM all-reduce, so a tensor counts once however many ranks repeat it. `layout`: where
        this rank sits (one process by default): the loss is averaged over its loss ranks, and
        its HSDP replicas are compared on full steps (one more small collective).
        `across_groups`: the loss averaged, the HSDP probe's flags and the riders' slots reduced
        by their kinds over fault-tolerant replica groups (parallel/replicas/groups.py), whose
        gradients were averaged before the monitor reads them; the preemption flag stays the
        group's.
        `riders`: numbers that ride along (an MoE model's router sums and extremes, the FP8
        layers' statistics): their SUM slots in the SUM all-reduce, their MAX slots in the MAX
        one, over ranks and groups.
        `checksums`: the gradient checksums (checksums.py), whose check vectors ride the SUM
        all-reduce on the steps they check, or why they are off."""
        self.cfg, self.names, self.device, self.use_kernel = cfg, names, device, use_kernel
        self.layout = layout if layout is not None else Layout(world_size=1)
        self.replica_group = self.layout.replica_group
        self.weights: torch.Tensor | None = None
        if replication is not None and any(r != 1 for r in replication):
            assert len(replication) == len(names), "one replication count per tensor"
            self.weights = 1.0 / torch.tensor(replication, dtype=torch.float32, device=device)
        self.stats_kernel = None
        if use_kernel:  # imports triton: only where it runs
            from bigtrain.monitor.kernel import GradStatsKernel

            self.stats_kernel = GradStatsKernel()
        self.last_local: torch.Tensor | None = None
        self.across_groups = across_groups
        self.riders = list(riders)
        self.sizes: torch.Tensor | None = None  # values per local shard, kept from the first step
        self.history = ShardHistory(
            cfg.suspicion.window, len(names), device, cfg.suspicion.neighbours
        )
        self.checksums = checksums if isinstance(checksums, GradChecksums) else None
        self.checksum_coverage = (
            checksums.coverage if isinstance(checksums, GradChecksums) else checksums
        )
        self.layouts: dict[tuple[bool, bool], SlotLayout] = {}  # by full step, checked (`slots`)

    def begin(self, step: int) -> None:
        """Before the step's forwards, and a replay's: the checksums' expected side from 0."""
        if self.checksums is not None:
            self.checksums.begin(step)

    @property
    def checking(self) -> bool:
        """This step's gradients are checked against their checksums."""
        return self.checksums is not None and self.checksums.active

    def checksum_record(self) -> dict[str, Any]:
        """What the gradient checksums cover, for the start event ({} when never set up)."""
        coverage = self.checksum_coverage
        return coverage.record() if coverage is not None else {}

    def mismatches(self, health: Health) -> list[list]:
        """[name, residual] of the tensors whose gradient checksums mismatched at the step of
        `health` (checksums.py), largest first; [] on unchecked steps."""
        if self.checksums is None or health.checksums is None:
            return []
        return self.checksums.mismatches(health.checksums)

    def stop_checking(self, names: list[str]) -> None:
        """Tensors whose checksums mismatch deterministically (checksums.py `drop`)."""
        if self.checksums is not None:
            self.checksums.drop(names)

    def full_step(self, step: int, log_step: bool) -> bool:
        """Max |g| per tensor (telemetry, the anomaly report) every `monitor.every` steps and at
        log steps; other steps compute the sums of squares and non-finite counts only."""
        return log_step or (self.cfg.every > 0 and step % self.cfg.every == 0)

    def slots(self, full: bool, checked: bool = False) -> SlotLayout:
        """What a step's collectives carry, declared once per kind of step: the gradient
        statistics and the loss (max |g| on full steps), the preemption request, on full steps
        under HSDP one difference flag per replica, the suspicion tier's shard statistics, the
        riders' slots, on checked steps the checksums' vectors."""
        if (full, checked) not in self.layouts:
            slots = grad_slots(len(self.names), full) + [Slot(STOP, 1, "sum")]
            if full and self.replica_group is not None:
                slots.append(Slot(REPLICAS, self.layout.replicate, "sum"))
            if self.cfg.suspicion.enabled:
                slots.append(shard_slot(len(self.names)))
            for rider in self.riders:
                slots += rider.slots()
            if checked and self.checksums is not None:
                slots += self.checksums.slots()
            self.layouts[(full, checked)] = SlotLayout(slots)
        return self.layouts[(full, checked)]

    def check(
        self,
        named_grads: list[tuple[str, torch.Tensor]],
        local_loss: torch.Tensor,
        grad_factor: float,
        full: bool,
        stop_requested: bool = False,
        loss_scale: float = 1.0,
    ) -> Health:
        """`grad_factor`: the loss scale the gradients still carry (1.0 once unscaled);
        `loss_scale`: the one the backward ran under (the checksums' expected side carries it)."""
        assert [n for n, _ in named_grads] == self.names, "gradients are aligned on every rank"
        stats = local_grad_stats(named_grads, self.device, full, self.use_kernel, self.stats_kernel)
        # This rank's own numbers, before the reduction: a replay compares them between its runs.
        self.last_local = torch.cat([stats.sum_sq, stats.nonfinite, local_loss.float().reshape(1)])
        values = stats_values(weighted_stats(stats, self.weights))
        values[LOSS] = local_loss
        values[STOP] = torch.tensor([float(stop_requested)], device=self.device)
        if full and self.replica_group is not None:  # the HSDP consistency probe
            local = torch.cat([stats.sum_sq, stats.nonfinite])
            values[REPLICAS] = replica_differences(local, self.replica_group)
        for rider in self.riders:
            values.update(rider.take(self.device))
        levels = self._levels(named_grads, stats.sum_sq, grad_factor)
        if levels is not None:
            values[SHARDS] = self.history.statistics(levels)
        checked = self.checking
        if checked:
            assert self.checksums is not None
            values.update(self.checksums.take(named_grads, grad_factor, loss_scale))
        pack = reduce_grad_stats(self.slots(full, checked).fill(values), self.layout.loss_ranks)
        if self.across_groups is not None:
            pack = self._across_groups(pack)
        stats = scale_stats(packed_stats(self.names, pack), grad_factor)
        norm = stats.global_norm
        extra = {GRAD_NORM: norm}
        if checked:
            assert self.checksums is not None
            extra[CHECKSUMS] = self.checksums.residuals(pack, norm)
        host = pack.replaced(stats_values(stats)).read(extra)
        sum_sq, nonfinite, max_abs = host[SUM_SQ], host[NONFINITE], host.get(MAX_ABS)
        telemetry: dict[str, Any] = {"grad_nonfinite": weighted_count(sum(nonfinite))}
        for rider in self.riders:
            telemetry.update(rider.read(host))
        if max_abs is not None:
            layer_norm, layer_max = layer_stats(self.names, sum_sq, max_abs)
            telemetry.update(layer_grad_norm=layer_norm, layer_grad_max=layer_max)
        return Health(
            pack[LOSS].reshape(()),
            norm,
            stats,
            host_loss=host[LOSS][0],
            host_grad_norm=host[GRAD_NORM][0],
            num_nonfinite=telemetry["grad_nonfinite"],
            host_sum_sq=sum_sq,
            host_nonfinite=nonfinite,
            host_max_abs=max_abs,
            replicas=[r for r, v in enumerate(host.get(REPLICAS) or []) if v > 0],
            telemetry=telemetry,
            stop_requested=host[STOP][0] > 0,
            grad_factor=grad_factor,
            shards=host.get(SHARDS),
            levels=levels,
            checksums=host.get(CHECKSUMS),
        )

    def _across_groups(self, pack: Pack) -> Pack:
        """The loss averaged, the replica flags and the riders' slots summed or maxed (by their
        kinds) over the replica groups. The gradient and shard statistics need not cross (the
        groups' gradients are equal); the preemption request stays the group's own."""
        assert self.across_groups is not None
        riding = [slot for rider in self.riders for slot in rider.slots()]
        summed = {k: pack[k] for k in (REPLICAS,) if k in pack}
        summed |= {s.name: pack[s.name] for s in riding if s.reduce == "sum"}
        maxed = {s.name: pack[s.name] for s in riding if s.reduce == "max"}
        loss, summed, maxed = self.across_groups(pack[LOSS], summed, maxed)
        return pack.replaced({LOSS: loss} | summed | maxed)

    def max_abs(
        self, named_grads: list[tuple[str, torch.Tensor]], grad_factor: float
    ) -> list[float]:
        """Max |g| per tensor over all ranks, computed now (an anomaly found on a step without
        them: the report names tensors by it). A collective: every rank calls it."""
        stats = local_grad_stats(named_grads, self.device, True, self.use_kernel, self.stats_kernel)
        max_abs = torch.where(stats.max_abs.isnan(), float("inf"), stats.max_abs)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(max_abs, op=dist.ReduceOp.MAX)
        # Expensive device-to-host synchronization, on anomalous steps only.
        return (max_abs / grad_factor).tolist()

    def local_state_dict(self) -> dict[str, Any]:
        """This rank's own state (a host copy): its shard history."""
        return {"shards": self.history.state_dict()}

    def load_local_state_dict(self, state: dict[str, Any]) -> None:
        self.history.load_state_dict(state.get("shards", {}))

    def accept(self, health: Health) -> None:
        """The step is kept: its shard levels join this rank's history (shards.py)."""
        if health.levels is not None:
            self.history.add(health.levels)

    def _levels(
        self, named_grads: list[tuple[str, torch.Tensor]], sum_sq: torch.Tensor, grad_factor: float
    ) -> torch.Tensor | None:
        """This rank's shard levels for the suspicion tier (None when it is off)."""
        if not self.cfg.suspicion.enabled:
            return None
        if self.sizes is None:  # shapes do not change within a run: one host-to-device copy
            sizes = [g.numel() for _, g in named_grads]
            self.sizes = torch.tensor(sizes, dtype=torch.float32, device=self.device)
        return shard_levels(sum_sq, self.sizes, grad_factor)
