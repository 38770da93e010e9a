"""The suspicion tier (resilience/suspect.py): the shard statistics it reads, its verdicts, and the
replays it asks for: silent data corruption comes out transient and leaves no trace, a spike of
the data's is reproduced and never called transient, and replaying healthy steps changes
nothing."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from bigtrain.config.resilience import SuspicionConfig
from bigtrain.errors import ConfigError
from bigtrain.monitor.levels import EMPTY, ShardHistory, shard_levels, shard_statistics
from bigtrain.parallel.env import DistEnv
from bigtrain.resilience.suspect import Suspicion, series
from bigtrain.runner import run
from bigtrain.store.rundir import read_jsonl
from tests.distributed import run_distributed, train_run

TENSOR = "blocks.1.mlp.up.weight"


def shards(high: list[float], low: list[float], alone: list[float]) -> list[float]:
    """Health.shards: the largest and smallest rise over the ranks, the largest rise beyond a
    rank's median."""
    return high + [-v for v in low] + alone


@pytest.mark.unit
def test_shard_levels_are_log_mean_squares_without_the_loss_scale():
    out = shard_levels(torch.tensor([16.0, 0.0, float("inf")]), torch.tensor([4.0, 0, 2]), 2.0)
    assert out[0].item() == pytest.approx(0.0)  # 16 / 4 / 2^2 = 1
    assert math.isnan(out[1].item()) and math.isnan(out[2].item())  # not held; non-finite


@pytest.mark.unit
def test_a_shard_rises_over_its_own_median_and_beyond_its_ranks_median_rise():
    history = ShardHistory(window=3, num_tensors=3, device=torch.device("cpu"))
    nan = math.nan
    assert torch.isnan(history.center()).all()  # no accepted step yet
    for row in ([1.0, 5.0, nan], [2.0, 7.0, nan], [9.0, 6.0, nan], [3.0, 4.0, nan]):
        history.add(torch.tensor(row))  # the window keeps the last 3: [2, 7], [9, 6], [3, 4]
    assert history.center()[:2].tolist() == [3.0, 6.0] and math.isnan(history.center()[2])
    packed = shard_statistics(torch.tensor([4.0, 5.0, nan]), history.center())
    rise, neg, alone = packed.reshape(3, 3).tolist()
    assert rise[:2] == [1.0, -1.0] and neg[:2] == [-1.0, 1.0]
    assert alone[:2] == [2.0, 0.0]  # minus the lower median of the rises (1, -1): -1
    assert [rise[2], neg[2], alone[2]] == pytest.approx([EMPTY] * 3)  # not held (FP32)
    saved = history.state_dict()
    history.add(torch.tensor([0.0, 0.0, nan]))  # a copy: the saved ring does not move with it
    assert saved["levels"].device.type == "cpu" and 0.0 not in saved["levels"][:, :2]
    again = ShardHistory(window=3, num_tensors=3, device=torch.device("cpu"))
    again.load_state_dict(saved)
    assert again.center()[:2].tolist() == [3.0, 6.0] and again.count == 4
    again.add(torch.tensor([8.0, 8.0, nan]))  # the ring goes on where it was: [9, 6] [3, 4] [8, 8]
    assert again.center()[:2].tolist() == [8.0, 6.0]
    other = ShardHistory(window=3, num_tensors=2, device=torch.device("cpu"))
    other.load_state_dict(saved)  # another model (or world size): starts empty
    assert torch.isnan(other.center()).all() and other.count == 0


@pytest.mark.unit
def test_series_is_the_split_of_the_rises_or_a_lone_holders_rise_and_the_rise_alone():
    values = series(shards([1.0, 2.0, EMPTY], [-1.0, 2.0, -EMPTY], [0.5, 3.0, EMPTY]))
    assert values[0, 0] == 2.0  # two ranks: 1 - (-1)
    assert values[0, 1] == 2.0  # one holder (or equal rises): its rise
    assert values[1, :2].tolist() == [0.5, 3.0]
    assert np.isnan(values[:, 2]).all()  # no holder


@pytest.mark.unit
def test_a_tensor_is_suspected_only_when_it_jumps_past_both_series_limits():
    cfg = SuspicionConfig(factor=5.0, sigmas=6.0, alone_factor=3.0, window=20, min_values=10)
    watch = Suspicion(cfg, ["a", "b"])
    rng = np.random.default_rng(0)
    assert watch.check(shards([0.0, 0.0], [0.0, 0.0], [0.0, 0.0])) == []  # no history yet
    for _ in range(20):
        watch.add(shards(list(rng.normal(0, 0.1, 2)), [-3.0, -3.0], list(rng.normal(0, 0.1, 2))))
    split = 2 * math.log(5.0)  # the split's median is about 3: x5 in norm on top
    alone = 2 * math.log(3.0) + 0.3
    assert watch.check(shards([0.0, split - 0.2], [-3.0, -3.0], [0.0, alone])) == []
    assert watch.check(shards([0.0, split + 0.5], [-3.0, -3.0], [0.0, alone - 0.6])) == []
    (hit,) = watch.check(shards([0.0, split + 0.5], [-3.0, -3.0], [0.0, alone]))
    assert hit[0] == "b" and 5.0 < hit[1] < 8.0
    again = Suspicion(cfg, ["a", "b"])
    again.load_state_dict(watch.state_dict())
    assert again.check(shards([0.0, split + 0.5], [-3.0, -3.0], [0.0, alone]))[0][0] == "b"
    earlier = Suspicion(cfg, ["a", "b"])  # an earlier bigtrain's history: one series
    earlier.load_state_dict({"values": [[0.0, 0.0]] * 20})
    assert not earlier.values
    off = Suspicion(SuspicionConfig(enabled=False), ["a", "b"])
    off.values = watch.values
    assert off.check(shards([0.0, 99.0], [-3.0, -3.0], [0.0, 99.0])) == []


def local_run(micro, name: str, *extra: str) -> tuple[dict, list[dict]]:
    cfg = micro("train.max_steps=24", "train.eval_every=0", "checkpoint.every=-1", *extra, out=name)
    final = run(cfg, DistEnv())
    return final, read_jsonl(Path(cfg.train.out_dir) / "events.jsonl")


def of_kind(events: list[dict], kind: str) -> list[dict]:
    return [e for e in events if e["kind"] == kind]


def at_step(events: list[dict], kind: str, step: int) -> dict:
    """The `kind` event of `step`; any other of that kind is a healthy step's reproduced replay
    (numerics differ between CPUs: a healthy step may be suspected elsewhere)."""
    found = {e["step"]: e for e in of_kind(events, kind)}
    assert all(e["verdict"] == "reproduced" for s, e in found.items() if s != step)
    return found[step]


@pytest.mark.e2e
def test_replaying_every_healthy_step_changes_nothing(micro):
    """A tier that suspects every step (factor ~1, no sigmas) replays them all, reproduced: the
    run ends where the run without the tier does."""
    off, _ = local_run(micro, "off", "monitor.suspicion.enabled=false")
    always = ["monitor.suspicion.factor=1.000001", "monitor.suspicion.sigmas=0"]
    always += ["monitor.suspicion.alone_factor=1.000001", "monitor.suspicion.alone_sigmas=0"]
    on, events = local_run(micro, "on", *always)
    suspicions = of_kind(events, "suspicion")
    assert len(suspicions) >= 20 and {e["verdict"] for e in suspicions} == {"reproduced"}
    assert on["fingerprint"] == off["fingerprint"] and on["loss"] == off["loss"]
    replays = on["costs"]["replays"]  # their time is counted as replays, not as work
    assert replays["count"] == len(suspicions) and off["costs"]["replays"]["count"] == 0
    assert replays["seconds"] == pytest.approx(sum(e["seconds"] for e in suspicions), abs=1e-3)


@pytest.mark.e2e
def test_a_resumed_run_suspects_what_the_straight_run_does(micro):
    """Each rank's shard history travels in its own checkpoint file (local_rank0.pt): after a
    resume the tier judges every step from the same history, naming the same tensors with the
    same jumps (without it, the step after the resume would have no rises at all)."""
    always = ["monitor.suspicion.factor=1.000001", "monitor.suspicion.sigmas=0"]
    always += ["monitor.suspicion.alone_factor=1.000001", "monitor.suspicion.alone_sigmas=0"]
    _, straight = local_run(micro, "straight", *always)
    stopped = micro("train.max_steps=24", "train.stop_at_step=12", *always, out="resumed")
    run(stopped, DistEnv())
    saved = Path(stopped.train.out_dir) / "checkpoints/step_00000012/local_rank0.pt"
    history = torch.load(saved, weights_only=True)["shards"]
    assert history["count"] == 12 and history["levels"].shape[0] == 20
    assert torch.isfinite(history["levels"][:12]).any(dim=1).all()  # 12 accepted steps
    _, resumed = local_run(micro, "resumed", *always)

    def judged(events: list[dict]) -> list[tuple]:
        return [(e["step"], e["tensors"]) for e in of_kind(events, "suspicion") if e["step"] > 12]

    assert judged(straight) and judged(resumed) == judged(straight)


@pytest.mark.e2e
def test_corruption_is_transient_and_leaves_no_trace_a_data_spike_is_reproduced(micro):
    clean, _ = local_run(micro, "clean")
    drill = [f"fault.grad_tensor={TENSOR}", "fault.spike_factor=1000"]
    sdc, events = local_run(micro, "sdc", "fault.grad_spike_step=[18]", *drill)
    suspicion = at_step(events, "suspicion", 18)
    assert (suspicion["verdict"], suspicion["rank"]) == ("transient", 0)
    assert suspicion["tensors"][0][0] == TENSOR and suspicion["tensors"][0][1] > 100
    assert sdc["fingerprint"] == clean["fingerprint"] and sdc["anomalies"] == 0
    data, events = local_run(micro, "data", "fault.data_spike_step=[18]", *drill)
    suspicion = at_step(events, "suspicion", 18)
    assert (suspicion["verdict"], suspicion["rank"]) == ("reproduced", None)
    assert data["fingerprint"] != clean["fingerprint"]  # the data's spike was applied
    flip, events = local_run(
        micro, "flip", "fault.bitflip_step=[18]", f"fault.grad_tensor={TENSOR}"
    )
    (replay,) = of_kind(events, "replay")  # x2^128: the anomaly tier's, replayed: clean
    assert (replay["step"], replay["verdict"]) == (18, "transient")
    assert all(e["verdict"] == "reproduced" for e in of_kind(events, "suspicion"))
    assert flip["fingerprint"] == clean["fingerprint"]
    # The same flip in an activation: x2^128 in one value of an MLP's output overflows the next
    # layer norm's FP32 variance, which zeroes that token's vector: masked, not caught.
    masked, events = local_run(
        micro, "act", "fault.bitflip_step=[18]", "fault.bitflip_activation=blocks.0.mlp"
    )
    (fault,) = of_kind(events, "fault")
    assert fault["module"] == "blocks.0.mlp" and abs(fault["after"]) > 1e30 * abs(fault["before"])
    assert masked["anomalies"] == 0 and masked["fingerprint"] != clean["fingerprint"]
    with pytest.raises(ConfigError, match=r"'fault\.bitflip_activation' got 'blocks\.0\.mlpx'"):
        local_run(micro, "bad", "fault.bitflip_step=[3]", "fault.bitflip_activation=blocks.0.mlpx")


@pytest.mark.distributed
def test_on_two_fsdp_ranks_the_corrupted_rank_is_named_and_the_data_spike_is_not_transient(
    micro_args,
):
    common = ["parallel.backend=fsdp", "train.max_steps=24", "train.eval_every=0"]
    common += ["checkpoint.every=-1", "fault.rank=1", f"fault.grad_tensor={TENSOR}"]
    common += ["fault.spike_factor=1000"]
    faults = ["fault.grad_spike_step=[14]", "fault.data_spike_step=[18]"]
    faults += ["fault.bitflip_step=[22]"]  # the highest exponent bit of one gradient value
    result = run_distributed(train_run, 2, micro_args(*common, *faults))[0]
    by_step = {e["step"]: e for e in result["events"] if e["kind"] in ("suspicion", "replay")}
    assert (by_step[14]["kind"], by_step[14]["verdict"], by_step[14]["rank"]) == (
        "suspicion",
        "transient",
        1,
    )
    assert (by_step[18]["verdict"], by_step[18]["rank"]) == ("reproduced", None)
    assert (by_step[22]["verdict"], by_step[22]["rank"]) == ("transient", 1)
    assert result["final"]["anomalies"] == 0 and result["final"]["rollbacks"] == 0
