"""The monitor on an HSDP mesh (replicate 2 x shard 2, 4 gloo ranks): replicated shards count once
in the norm, and replicas whose gradients differ are an anomaly that names the replica."""

from __future__ import annotations

import math

import pytest
import torch

from bigtrain.config.schema import MonitorConfig
from bigtrain.monitor.monitor import GradMonitor
from bigtrain.resilience import Detector
from tests.distributed import run_distributed

pytestmark = pytest.mark.distributed


def shard_grads(shard: int) -> list[tuple[str, torch.Tensor]]:
    """This shard's part of two tensors: the same on both replicas of the shard."""
    g = torch.Generator().manual_seed(shard)
    return [("a", torch.randn(10, generator=g)), ("b", torch.randn(4, generator=g))]


def probe(perturbed_rank: int) -> tuple[float, dict | None, dict | None]:
    import torch.distributed as dist

    from bigtrain.parallel.layout import Layout

    dist.init_process_group("gloo")
    layout = Layout(4, dist.get_rank(), replicate=2, shard=2).connect("cpu")
    named = shard_grads(layout.coord("shard"))
    if dist.get_rank() == perturbed_rank:  # a corrupted all-reduce on one replica
        named[1][1][0] += 1e-3
    cpu = torch.device("cpu")
    monitor = GradMonitor(MonitorConfig(), ["a", "b"], cpu, False, [2, 2], layout)
    detector = Detector(MonitorConfig(), ["a", "b"])
    cheap = monitor.check(named, torch.tensor(2.0), 1.0, full=False)
    full = monitor.check(named, torch.tensor(2.0), 1.0, full=True)
    dist.destroy_process_group()
    verdicts = [detector.verdict(h, loss_scaled=False).anomaly for h in (cheap, full)]
    return cheap.host_grad_norm, *[a.details() if a else None for a in verdicts]


def test_replicated_shards_count_once_and_agreeing_replicas_are_healthy():
    ranks = run_distributed(probe, 4, -1)
    squares = sum(float(g.double().square().sum()) for s in (0, 1) for _, g in shard_grads(s))
    for norm, cheap, full in ranks:
        assert norm == pytest.approx(math.sqrt(squares), rel=1e-6)
        assert cheap is None and full is None


def test_replicas_that_disagree_are_an_anomaly_naming_the_replica_on_every_rank():
    """Rank 3 is replica 1 of shard 1: the probe runs on full steps only (every monitor.every)."""
    for _, cheap, full in run_distributed(probe, 4, 3):
        assert cheap is None
        assert full["type"] == "replica" and full["metric"] == "replicas"
        assert full["replicas"] == [1] and full["value"] == 1.0
