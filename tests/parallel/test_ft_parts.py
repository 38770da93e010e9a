"""The parts of parallel/replicas/groups.py that need no lighthouse: group indices, gradient buckets, the
group-aware run directory and lock, and the kill drill's once-per-run-directory marker."""

from __future__ import annotations

import json

import pytest
import torch
from torch.distributed import ReduceOp

from bigtrain.build import BuiltParts, make_callbacks, writes_run_files
from bigtrain.callbacks.cost_ledger import CostLedger
from bigtrain.checkpoint.manager import CheckpointManager
from bigtrain.config import load_config
from bigtrain.errors import ConfigError
from bigtrain.parallel.env import DistEnv
from bigtrain.parallel.layout import Layout
from bigtrain.parallel.replicas import connect, weights
from bigtrain.parallel.replicas import groups as ft
from bigtrain.store.rundir import RunDir, read_jsonl
from bigtrain.store.runlock import lock_run_dir
from bigtrain.utils.clock import StartupClock

pytestmark = pytest.mark.unit


def test_group_index_comes_from_the_environment(monkeypatch):
    assert connect.group_index(1) == 0
    monkeypatch.setenv(connect.GROUP_ENV, "2")
    assert connect.group_index(3) == 2
    monkeypatch.setenv(connect.GROUP_ENV, "3")
    with pytest.raises(ConfigError, match="BIGTRAIN_FT_GROUP set to its replica group"):
        connect.group_index(3)
    monkeypatch.delenv(connect.GROUP_ENV)
    with pytest.raises(ConfigError, match="got None"):
        connect.group_index(2)


def test_lighthouse_address_from_the_key_or_the_environment(monkeypatch):
    cfg = load_config([], [])
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(ConfigError, match="fault_tolerance.lighthouse"):
        connect.lighthouse_address(cfg.fault_tolerance)
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://h:1")
    assert connect.lighthouse_address(cfg.fault_tolerance) == "http://h:1"


def test_group_ids_read_torchfts_replica_ids():
    assert connect.group_ids(["group2:abc", "group0:def", "group10:x"]) == [0, 2, 10]


def test_buckets_keep_one_dtype_and_a_bounded_size(monkeypatch):
    monkeypatch.setattr(ft, "BUCKET_ELEMENTS", 10)
    grads = [
        torch.zeros(4),
        torch.zeros(4),
        torch.zeros(4),
        torch.zeros(2, dtype=torch.bfloat16),
        torch.zeros(30),
    ]
    sizes = [[g.numel() for g in b] for b in ft._buckets(grads)]
    assert sizes == [[4, 4], [4], [2], [30]]
    assert all(len({g.dtype for g in b}) == 1 for b in ft._buckets(grads))


def test_the_layout_counts_replica_groups_in_the_data_parallel_ranks():
    cfg = load_config([], ["parallel.backend=fsdp"])
    layout = Layout.of(cfg.parallel, 2, rank=1, ft=3, ft_group=2)
    assert (layout.dp_size, layout.dp_rank, layout.world_size) == (6, 5, 2)
    assert layout.describe().startswith("ft 3")


def test_events_carry_the_group_and_only_the_leader_writes_metrics(tmp_path):
    run_dir = RunDir(tmp_path, True, group=2)
    run_dir.event(1, "quorum", participants=[0, 2])
    run_dir.metrics({"step": 1})  # not the leader yet: nothing
    run_dir.leader = True
    run_dir.metrics({"step": 2})
    assert read_jsonl(tmp_path / "events.jsonl")[0]["group"] == 2
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 2}]
    plain = RunDir(tmp_path / "plain", True)
    assert plain.leader and "group" not in plain.event(1, "start")


def test_each_group_locks_its_own_part_of_the_run_directory(tmp_path):
    locks = [lock_run_dir(RunDir(tmp_path, True, group=g), 30, True) for g in (0, 1)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock.group0", ".lock.group1"]
    owner = json.loads((tmp_path / ".lock.group1").read_text())
    assert owner["pid"] > 0
    for lock in locks:
        lock.release()


def test_run_files_are_written_by_group_0_while_they_are_missing(tmp_path):
    assert writes_run_files(RunDir(tmp_path, True))
    assert writes_run_files(RunDir(tmp_path, True, group=0))
    assert not writes_run_files(RunDir(tmp_path, True, group=1))
    (tmp_path / "tokenizer").mkdir()
    assert not writes_run_files(RunDir(tmp_path, True, group=0))
    assert writes_run_files(RunDir(tmp_path, True))  # a plain run rewrites them


def test_only_group_0_feeds_the_metric_sinks(tmp_path):
    cfg = load_config([], [])
    manager = CheckpointManager(tmp_path / "checkpoints", keep=1)

    def names(group: int) -> list[str]:
        parts = BuiltParts([], {}, {}, str(tmp_path), ["sink"], CostLedger(StartupClock()), group)
        made = make_callbacks(cfg, DistEnv(), RunDir(tmp_path, True), manager, parts)
        return [type(c).__name__ for c in made]

    assert "SinkLogger" in names(0) and "SinkLogger" not in names(1)


def test_no_replica_groups_leave_every_step_as_it_is():
    none = ft.NoReplicaGroups()
    value = torch.tensor(2.0)
    assert none.average(value) is value and none.intact() and none.commit()
    assert none.across_groups is None and none.state_dict() == {} and none.leads


class TwoGroups:
    """torchft's Manager as across_groups uses it, with a second group's numbers: its allreduce
    applies the reduce_op to this group's tensor and `other`'s (one per call, in order)."""

    def __init__(self, *others: torch.Tensor) -> None:
        self.others, self.ops = list(others), []

    def allreduce(self, tensor, reduce_op):
        other = self.others.pop(0)
        self.ops.append(reduce_op)
        if reduce_op == ReduceOp.SUM:
            tensor.add_(other)
        else:
            torch.maximum(tensor, other, out=tensor)
        return self

    def wait(self) -> None:
        return None

    def num_participants(self) -> int:
        return 2


def two_groups(manager) -> ft.ReplicaGroups:
    """Group 0 of two, without torchft: `manager` stands in for its Manager."""
    groups = object.__new__(ft.ReplicaGroups)
    groups.manager, groups.groups = manager, 2
    groups.layout = Layout.of(load_config([], []).parallel, 1, ft=2, ft_group=0)
    return groups


def test_across_groups_averages_the_loss_sums_flags_and_maxes_router_extremes():
    # The other group: loss 3, 1 differing replica, router sum 5, its own loss in its slot
    # (group 1) and its own work's seconds on its last timing step (1.5) in its slot; router
    # extremes [0.2, 0.9]; zeros: a group sitting out. The stop flag is not passed: the group's.
    groups = two_groups(
        TwoGroups(torch.tensor([3.0, 1.0, 5.0, 0.0, 3.0, 0.0, 1.5]), torch.tensor([0.2, 0.9]))
    )
    groups.compute_s = 0.5
    loss, summed, maxed = groups.across_groups(
        torch.tensor([1.0]),
        {"replicas": torch.tensor([0.0]), "router_sums": torch.tensor([2.0])},
        {"router_extremes": torch.tensor([0.5, 0.1])},
    )
    assert loss.item() == 2.0
    assert {k: v.tolist() for k, v in summed.items()} == {"replicas": [1.0], "router_sums": [7.0]}
    assert groups.group_losses.tolist() == [1.0, 3.0]  # each group's own loss
    groups.participants = [0, 1]
    assert groups.group_times() == {0: 0.5, 1: 1.5}
    assert maxed["router_extremes"].tolist() == pytest.approx([0.5, 0.9])
    assert groups.manager.ops == [ReduceOp.SUM, ReduceOp.MAX]
    groups = two_groups(TwoGroups(torch.tensor([3.0, 0.0, 3.0, 0.0, 0.0])))
    groups.compute_s, groups.participants = 0.0, [0, 1]
    assert groups.across_groups(torch.tensor(1.0), {}, {})[1:] == ({}, {})  # dense, no HSDP
    assert groups.manager.ops == [ReduceOp.SUM]  # no MAX without maxed parts
    assert groups.group_times() == {}  # no group timed a step yet


def test_weights_are_compared_rank_by_rank_and_the_odd_group_named():
    # two ranks per group; group 2's rank 1 shard differs
    by_rank = [{0: "a", 1: "a", 2: "a"}, {0: "b", 1: "b", 2: "c"}]
    by_group = weights.weight_groups(by_rank)
    assert by_group == {0: ("a", "b"), 1: ("a", "b"), 2: ("a", "c")}
    assert weights.odd_groups(by_group, leading=0) == [2]
    # a tie goes the leading group's way (it writes the checkpoints)
    assert weights.odd_groups({0: ("x",), 1: ("y",)}, leading=1) == [0]
    assert weights.odd_groups({0: ("x",), 1: ("x",)}, leading=0) == []
    # a group one rank did not see is not compared
    assert weights.weight_groups([{0: "a", 1: "a"}, {0: "b"}]) == {0: ("a", "b")}


def test_the_local_digest_follows_every_byte_of_the_master_weights():
    class Masters:
        def __init__(self, *tensors):
            self.tensors = list(tensors)

        def master_state(self):
            return self.tensors, {}

    a = weights.local_digest(Masters(torch.ones(3), torch.zeros(2)))
    assert a == weights.local_digest(Masters(torch.ones(3), torch.zeros(2)))
    flipped = torch.zeros(2)
    flipped.view(torch.int32)[1] = 1  # the smallest denormal: one bit
    assert a != weights.local_digest(Masters(torch.ones(3), flipped))
    assert len(a) == 32


def test_a_group_left_out_is_dead_or_late_by_what_the_quorum_saw():
    def reason(waited, join=60.0, failed=False):
        return ft.late_reason(waited, 2.0, join, failed)

    assert reason(1.4) == "dead"  # a silent group: within a heartbeat timeout (and a tick)
    assert reason(2.5) == "dead"
    assert reason(59.8) == "late"  # the lighthouse waited its join timeout for it
    assert reason(45.0) == "late"  # ... from the first group's join: this one came later
    assert reason(59.8, failed=True) == "dead"  # a reduction with it broke: it died
    assert reason(0.05, join=0.3) == "late"  # a join timeout below the heartbeat's runs out first


def test_an_unreachable_lighthouse_is_named_at_once():
    from bigtrain.parallel.env import free_port

    reason = connect.unreachable(f"http://127.0.0.1:{free_port()}", 2.0)
    assert reason is not None and "cannot be reached" in reason
    assert connect.unreachable("http://nowhere", 2.0) == "is not http://HOST:PORT"


@pytest.mark.parametrize("states", ["fp32", "bf16"])
def test_a_peers_state_makes_the_next_step_the_peers_own(micro, states):
    """What a rejoining group receives (RunState.peer_state) puts a fresh trainer where the peer is: the
    same counters, data cursor, healer state and RNG, and the next step gives the peer's loss and
    weights bit for bit (BF16 optimizer states included)."""
    from dataclasses import asdict

    from bigtrain.build import build_trainer
    from bigtrain.parallel.env import DistEnv

    common = (
        "train.max_steps=12",
        "train.eval_every=0",
        f"precision.optimizer_state_dtype={states}",
    )
    peer = build_trainer(micro(*common, "train.stop_at_step=5", out="peer"), DistEnv())
    peer.fit()
    state = peer.run.peer_state()
    fresh = build_trainer(micro(*common, out="joined"), DistEnv())
    assert fresh.state.step == 0
    fresh.run.load_peer_state(state)
    assert asdict(fresh.state) == asdict(peer.state) and fresh.state.step == 5
    assert fresh.loader.stream.state_dict() == peer.loader.stream.state_dict()
    assert fresh.healer.state_dict() == peer.healer.state_dict()
    assert fresh.healer.detector.state_dict() == peer.healer.detector.state_dict()
    assert torch.equal(torch.get_rng_state(), state["rng"]["torch"])
    ours, theirs = fresh.train_step(), peer.train_step()
    assert ours.loss.item() == theirs.loss.item()
    assert fresh.backend.fingerprint() == peer.backend.fingerprint()
    for trainer in (peer, fresh):
        trainer.callbacks.close()


def test_a_rollback_after_a_join_restores_the_same_target_from_the_same_source(micro):
    """The peer's snapshots of its rollback targets come with its state: a NaN after the join
    rolls the joined trainer back exactly as the peer (from memory, to the same step), not to
    an older state it would have to train forward from."""
    from bigtrain.build import build_trainer
    from bigtrain.parallel.env import DistEnv

    common = (
        "train.max_steps=12",
        "train.eval_every=0",
        "checkpoint.every=0",
        "resilience.snapshot_every=2",
        "resilience.confirm_steps=1",
        "drill.nan_grad_step=[7]",
        "resilience.replay=false",
    )
    peer = build_trainer(micro(*common, "train.stop_at_step=5", out="peer"), DistEnv())
    peer.fit()
    fresh = build_trainer(micro(*common, out="joined"), DistEnv())
    fresh.healer.start(resumed=False)
    fresh.run.load_peer_state(peer.run.peer_state())
    held = [t.step for t in fresh.healer.targets.ring if t.held is not None]
    assert held == [t.step for t in peer.healer.targets.ring if t.held is not None] and held
    for trainer in (peer, fresh):
        for _ in range(2):  # steps 6 and 7: the NaN at 7 rolls back
            result = trainer.train_step()
            trainer.healer.after_step(result)
            trainer.callbacks.on_step_end(trainer, result)
            trainer.healer.end_step()
    rollbacks = [read_jsonl(t.run_dir.path / "events.jsonl") for t in (peer, fresh)]
    (ours,), (theirs,) = (
        [e for e in r if e["kind"] == "rollback"] for r in (rollbacks[1], rollbacks[0])
    )
    assert (
        (ours["to_step"], ours["source"]) == (theirs["to_step"], theirs["source"]) == (4, "memory")
    )
    assert fresh.state.step == peer.state.step == 4
    assert fresh.backend.fingerprint() == peer.backend.fingerprint()
    for trainer in (peer, fresh):
        trainer.callbacks.close()


def test_a_slow_group_leaves_only_when_the_policy_says_and_the_others_stop_waiting(tmp_path):
    """slow_group_leaves_after=2: group 1, named on 2 timing steps in a row, leaves (GroupLeft,
    exit 0) with a `group_left` event (reason `slow`); group 0 records it as gone, so that the
    end does not wait for it. With the default (0) nobody leaves."""
    from types import SimpleNamespace

    from bigtrain.errors import GroupLeft
    from bigtrain.train.step import StepResult

    def group(g: int, after: int):
        groups = two_groups(None)
        groups.layout = Layout.of(load_config([], []).parallel, 1, ft=2, ft_group=g)
        groups.cfg = load_config([], [f"fault_tolerance.slow_group_leaves_after={after}"])
        groups.cfg = groups.cfg.fault_tolerance
        groups.gone, groups.leads = set(), g == 0
        groups.events = sink
        return groups

    events = []
    sink = SimpleNamespace(event=lambda kind, **d: events.append({"kind": kind, **d}))
    named = StepResult(step=6, lr=1e-3, slow_groups={1: 2})
    for after in (0, 3):  # waiting, or not yet
        for g in (0, 1):
            group(g, after).after_step(named)
    assert events == []
    leader = group(0, 2)
    leader.after_step(named)
    assert leader.gone == {1}
    with pytest.raises(GroupLeft, match="replica group 1 left the job"):
        group(1, 2).after_step(named)
    assert [(e["group"], e["reason"], e["reported_by"]) for e in events] == [
        (1, "slow", 0),
        (1, "slow", 1),
    ]


def test_a_group_whose_reduction_failed_closes_its_connections_before_the_step_runs_again():
    """After a failed reduction the group aborts its process group (a peer waiting in a later
    reduction for it fails at once instead of after the 30 s timeout); a vote that failed
    without an error leaves it be."""
    from types import SimpleNamespace

    class Manager:
        def __init__(self, error):
            self.error = error

        def errored(self):
            return self.error

        def num_participants(self):
            return 2

    class PG:
        aborted = 0

        def abort(self):
            PG.aborted += 1

    events = []
    run = SimpleNamespace(
        backend=SimpleNamespace(skip_step=lambda: None),
        stream=SimpleNamespace(load_state_dict=lambda s: None),
        counters=SimpleNamespace(transients={}),
    )
    sink = SimpleNamespace(event=lambda kind, **d: events.append(kind))
    for error, aborted in ((RuntimeError("Connection closed by peer"), 1), (None, 1)):
        groups = two_groups(Manager(error))
        groups.pg, groups.cfg = PG(), load_config([], []).fault_tolerance
        groups.run, groups.events = run, sink
        groups.abandon(({}, ft.rng_state(), {}), step=7)
        assert PG.aborted == aborted and groups.reduction_failed == (error is not None)
    assert events == ["commit_failed", "commit_failed"]
