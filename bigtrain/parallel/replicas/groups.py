"""Fault-tolerant replica groups on torchft: the outermost data-parallel dimension (Layout.ft),
made of separate jobs that may die and rejoin while the others keep training.

Each step, in every group (the loop calls these by name; NoReplicaGroups, for a run without
groups, does nothing):

    start_step   a quorum from the lighthouse (torchft Manager.start_quorum, synchronous): who
                 takes part. A group that is behind (restarted, or it failed to commit) receives
                 the whole state from a live peer here, before it reads its data: weights,
                 optimizer, trainer counters and LR back-off, the healer's targets and windows,
                 loss scale, the data cursor and RNG (RunState.peer_state, bigtrain/state/run.py).
    average_grads  after backward, the gradient shards are averaged over the live groups (one
                 all-reduce per bucket over torchft's reconfigurable process group: rank r of
                 every group holds the same shards). The monitor then reads gradients that are
                 the same in every group, so the norm, the non-finite counts and the per-tensor
                 maxima need no second reduction; `across_groups` averages the loss over the
                 groups, so every group reaches the same verdict in the same step.
    intact / commit  a reduction that failed (a group died inside the step) or a vote against
                 committing (torchft's should_commit) leaves the step unapplied in every group:
                 its gradients are dropped, the data cursor and RNG go back, and the step runs
                 again with the new quorum (`commit_failed` event).

    finish       at the end, quorum after quorum until every group takes part (or
                 quorum_timeout_s passed): a group that was behind or away catches up from a
                 peer; then the groups compare their weights (a digest of each rank's shards,
                 as after every persistent checkpoint) and a difference is an error (exit 7).

A rollback is a committed step whose outcome loads a target: torchft's step counter only grows,
so a group that joins during or after it receives the rolled-back state. Persistent checkpoints
are written by the quorum's first group (`leads`); every group writes its own events.

A group is left out of a quorum only when it is gone (its heartbeats stopped for
heartbeat_timeout_s) or later than the lighthouse's join timeout (fault_tolerance.join_timeout_s,
60 s): the group that leads writes a `group_left` event (reason `dead` or `late`), and so does the
left-out group itself when it finds it was left behind.
"""

from __future__ import annotations

import copy
import logging
import statistics
import time
from collections import deque
from datetime import timedelta
from typing import Any, Protocol

import torch
from torch.distributed import ReduceOp

from bigtrain.checkpoint.rng import rng_state, set_rng_state
from bigtrain.config.fault_tolerance import FaultToleranceConfig
from bigtrain.errors import GroupLeft, ReplicaMismatch
from bigtrain.parallel.backends.base import Backend
from bigtrain.parallel.layout import Layout
from bigtrain.parallel.replicas.connect import (
    Recorded,
    TimedTransport,
    group_ids,
    lighthouse_address,
    own_store,
    process_group,
    quiet_torchft,
    transport,
)
from bigtrain.parallel.replicas.weights import local_digest, odd_groups, weight_groups
from bigtrain.state.events import Events
from bigtrain.state.run import Cadence, RunState
from bigtrain.store.rundir import RunDir
from bigtrain.utils.clock import process_start_time
from bigtrain.utils.dist import all_gather_objects
from bigtrain.utils.tensors import local_tensor

logger = logging.getLogger(__name__)

BUCKET_ELEMENTS = 1 << 24
"""Gradient elements per cross-group all-reduce (64 MB of FP32): few collectives, bounded copies."""
FINISH_POLL_S = 0.05
"""Pause between the end's quorums while a group is still missing: short, so that the groups
present ask again together (the lighthouse's tick, 0.1 s, paces them) and a group that arrives
finds them all, whatever the join timeout."""
LATE_STEPS = 5
"""A join timeout shorter than this many median steps gets a warning (`join_timeout_short`)."""


class StepOutcome(Protocol):
    """What the replica groups read of a step's result and add to it (the loop's StepResult,
    train/step.py, is one)."""

    step: int
    step_time: float
    step_timing: dict[str, float] | None
    telemetry: dict[str, Any]  # written: loss_by_group at log steps
    slow_groups: dict[int, int] | None  # the straggler report's slow groups (timing steps)


def late_reason(
    waited_s: float, heartbeat_timeout_s: float, join_timeout_s: float, reduction_failed: bool
) -> str:
    """Why a group was left out of a quorum, by the lighthouse's two rules: `dead` when its
    heartbeats stopped (or a reduction with it failed in the step before), `late` when the join
    timeout ran out while it was still heartbeating. The quorum's wait tells them apart when
    the join timeout is well above the heartbeat timeout (a silent group is dropped about a
    heartbeat timeout after it fell silent, a live one only after the join timeout; half of it
    leaves room for a leader that joined late itself); with a join timeout about as short as
    the heartbeat's, it runs out first: `late`."""
    if reduction_failed:
        return "dead"
    if join_timeout_s <= heartbeat_timeout_s + 1.0:
        return "late"
    return "late" if waited_s > max(heartbeat_timeout_s + 1.0, join_timeout_s / 2) else "dead"


class NoReplicaGroups:
    """A run without replica groups: one job; every call leaves the step as it is."""

    groups = 1
    leads = True
    across_groups = None  # the monitor's numbers need no reduction across groups

    def attach(self, run: RunState, events: Events, run_dir: RunDir, cadence: Cadence) -> None:
        """No peer ever asks for the state."""

    def start_step(self) -> None:
        """Nothing to agree on."""

    def undo_point(self) -> None:
        return None

    def average_grads(self, backend: Backend) -> None:
        """The backend reduced the gradients over the job already."""

    def average(self, value: torch.Tensor) -> torch.Tensor:
        return value

    def intact(self) -> bool:
        return True

    def commit(self) -> bool:
        return True

    def abandon(self, undo: None, step: int) -> None:
        raise AssertionError("a run without replica groups commits every step")

    def annotate(self, result: StepOutcome) -> None:
        """Nothing to add to the step's record."""

    def group_times(self) -> dict[int, float]:
        """No other group to compare with."""
        return {}

    def after_step(self, result: StepOutcome) -> None:
        """No other group to wait for."""

    def finish(self) -> None:
        """One job: nothing to wait for or compare."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Nothing saved."""

    def close(self) -> None:
        """Nothing to shut down."""


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _buckets(grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The gradients in runs of one dtype and at most BUCKET_ELEMENTS elements (one at least)."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for g in grads:
        if out and out[-1][0].dtype == g.dtype and size + g.numel() <= BUCKET_ELEMENTS:
            out[-1].append(g)
            size += g.numel()
        else:
            out.append([g])
            size = g.numel()
    return out


class ReplicaGroups:
    """This group's torchft Manager and what the loop asks of it (module docstring)."""

    def __init__(self, cfg: FaultToleranceConfig, layout: Layout, device: torch.device) -> None:
        quiet_torchft()
        from torchft.manager import Manager

        self.cfg, self.layout, self.groups = cfg, layout, layout.ft
        timeout = timedelta(seconds=cfg.timeout_s)
        pg = self.pg = process_group(timeout, device)
        self.transport = TimedTransport(transport(cfg, pg, device))
        host, port, self._store = own_store(layout)
        self.manager = Manager(
            pg=pg,
            load_state_dict=None,
            state_dict=None,
            min_replica_size=cfg.min_groups,
            use_async_quorum=False,  # a rejoining group loads the state before reading data
            timeout=timeout,
            quorum_timeout=timedelta(seconds=cfg.quorum_timeout_s),
            connect_timeout=timeout,
            rank=layout.rank,
            world_size=layout.world_size,
            store_addr=host,
            store_port=port,
            lighthouse_addr=lighthouse_address(cfg) if layout.rank == 0 else None,
            replica_id=f"group{layout.ft_group}",
            checkpoint_transport=self.transport,
            init_sync=False,  # every group starts from the same seeded weights or checkpoint
        )
        self.client = Recorded(self.manager._client)
        self.manager._client = self.client  # type: ignore[assignment]
        self.participants: list[int] = []
        self.quorum_id: int | None = None
        self.leads = False  # until the first quorum says who leads
        self.device = device
        self.took_part = False  # this process was in a quorum already (a later heal: left out)
        self.reduction_failed = False  # the last step's reduction across groups failed
        self.last_commit: tuple[int, float] | None = None  # (step, wall time) of the last commit
        self.new_quorum = False  # the next commit is the first of a new membership
        self.fresh_quorum = False  # a quorum was formed and no step has used it yet
        self.group_losses: torch.Tensor | None = None  # each group's loss, from across_groups
        self.group_compute: torch.Tensor | None = None  # each group's own work (timing steps)
        self.compute_s = 0.0  # this group's own work on its last timing step
        self.warned_late = False
        self.mismatch: ReplicaMismatch | None = None  # the end's comparison found a difference
        self.resync = False  # vote against this step: weights differed after a checkpoint
        self.heals = 0  # peer states taken by this process (the weights' digest is cached)
        self.gone: set[int] = set()  # groups that left the job as stragglers (after_step)
        self.digest: tuple[tuple[int, int], bytes] | None = None
        self.step_times: deque[float] = deque(maxlen=200)

    def attach(self, run: RunState, events: Events, run_dir: RunDir, cadence: Cadence) -> None:
        """The run whose state a peer receives and a rejoining group loads (RunState.peer_state:
        torchft calls it on its quorum thread while the loop waits for the quorum; on CUDA the
        device is synchronized before, for the last step's kernels, and after, for the copies,
        so that no half-copied tensor is sent), where its events go, its run directory (this
        group leads the checkpoints; the REPLICAS_DIFFER marker) and its cadence."""
        self.run, self.events, self.run_dir, self.cadence = run, events, run_dir, cadence

        def send() -> dict[str, Any]:
            synchronize(self.device)
            state = run.peer_state()
            synchronize(self.device)
            return state

        self.manager.register_state_dict_fn("bigtrain", run.load_peer_state, send)

    def start_step(self) -> None:
        """The quorum of this step; a group behind the others loads a live peer's state here.
        Groups left out are reported; after a persistent checkpoint the groups compare weights."""
        own_step, asked = self.run.step, time.time()
        quorum = self._quorum()
        waited = time.time() - asked
        participants = group_ids(quorum.replica_ids)
        self.leads = self.run_dir.leader = self.manager.participating_rank() == 0
        self.fresh_quorum = True
        if quorum.quorum_id != self.quorum_id:  # a membership change (a group replaced too)
            self._membership(quorum.quorum_id, participants, waited)
        healed = quorum.heal and self.manager.errored() is None
        if healed and self.took_part and not self.reduction_failed:
            self._left_behind(own_step, waited)
        if healed:
            self.heals += 1
            self.events.event(
                "group_joined",
                at_step=self.run.step + 1,
                group=self.layout.ft_group,
                transfer_s=round(self.transport.received_s, 4),
                bytes=self.transport.received_bytes,
                source=quorum.recover_src_replica_rank,
                # the new process's own time from its start: only for a group that restarted
                **({} if self.took_part else {"seconds": _process_age()}),
            )
        self.took_part, self.reduction_failed = True, False
        # After a persistent checkpoint every group of the quorum (all at the same step now)
        # compares; the end has its own comparison (finish).
        every, step = self.cadence.checkpoint_every, self.run.step
        if every > 0 and 0 < step < self.cadence.end_step and step % every == 0:
            self._compare(final=False)

    def _membership(self, quorum_id: int, participants: list[int], waited: float) -> None:
        """A new quorum: its event (with this group's last commit before it, for the failure
        costs in the report), and the groups of the previous one that it left out."""
        self.quorum_id, self.new_quorum = quorum_id, True
        step, at = self.last_commit if self.last_commit is not None else (None, None)
        self.events.event(
            "quorum",
            at_step=self.run.step + 1,
            participants=participants,
            groups=len(participants),
            quorum_id=quorum_id,
            last_commit_step=step,
            last_commit_time=at,
            median_step_s=round(statistics.median(self.step_times), 4) if self.step_times else None,
        )
        if self.leads:
            for group in sorted(set(self.participants) - set(participants)):
                reason = late_reason(
                    waited,
                    self.cfg.heartbeat_timeout_s,
                    self.cfg.join_timeout_s,
                    self.reduction_failed,
                )
                self.events.event(
                    "group_left",
                    at_step=self.run.step + 1,
                    group=group,
                    reason=reason,
                    waited_s=round(waited, 3),
                    reported_by=self.layout.ft_group,
                )
        self.participants = participants

    def _left_behind(self, own_step: int, waited: float) -> None:
        """This live group was left out of a quorum it was late for: the others went on, and it
        took a peer's state now (its slice of the steps it missed is counted as skipped). The
        console prints the event (telemetry/console.py), here as on the leading group."""
        missed = max(self.run.step - own_step, 1)
        self.events.event(
            "group_left",
            at_step=own_step + 1,
            group=self.layout.ft_group,
            reason="late",
            missed_steps=missed,
            waited_s=round(waited, 3),
            reported_by=self.layout.ft_group,
        )

    def _quorum(self) -> Any:
        """torchft's quorum. A fresh job (nothing committed anywhere yet) asks again until every
        group takes part, for up to fault_tolerance.quorum_timeout_s: groups whose processes
        start at slightly different times begin together, not one or two steps apart."""
        deadline = time.monotonic() + self.cfg.quorum_timeout_s
        while True:
            self.manager.start_quorum()
            quorum = self.client.last
            fresh = quorum.max_step == 0 and not quorum.heal
            if not fresh or len(quorum.replica_ids) >= self.groups:
                return quorum
            if time.monotonic() > deadline:
                logger.warning(
                    "bigtrain: %d of %d replica groups after fault_tolerance.quorum_timeout_s=%g "
                    "s: starting without the others",
                    len(quorum.replica_ids),
                    self.groups,
                    self.cfg.quorum_timeout_s,
                )
                return quorum
            time.sleep(0.2)

    def undo_point(self) -> tuple[dict[str, Any], dict[str, Any], dict[str, int]]:
        """The data cursor, RNG and transient-fault counts before the step: an uncommitted step
        puts them back (its replay, if it had one, runs again with it)."""
        self.fresh_quorum = False
        stream = copy.deepcopy(self.run.stream.state_dict())
        return stream, rng_state(), dict(self.run.counters.transients)

    def average_grads(self, backend) -> None:
        """Mean of this rank's gradient shards over the live groups (rank r of each holds the
        same shards): after it, every group holds the gradient of the whole global batch."""
        grads = [local_tensor(p.grad) for p in backend.model.parameters() if p.grad is not None]
        for bucket in _buckets([g for g in grads if g.numel()]):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            self.manager.allreduce(flat).wait()  # AVG over the participants
            offset = 0
            for g in bucket:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    def across_groups(
        self,
        loss: torch.Tensor,
        summed: dict[str, torch.Tensor],
        maxed: dict[str, torch.Tensor],
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The monitor's numbers that differ between groups (their gradients were averaged
        before the monitor read them), reduced over the live groups and handed back by the same
        names: the loss averaged, the `summed` parts (the HSDP probe's flags, MoE router sums:
        replicas that differ in one group make every group act) summed, the `maxed` parts (the
        router extremes, the FP8 layers' statistics; zeros neutral: a group that sits out sends
        zeros) maxed. What the
        monitor does not pass stays the group's: its preemption flag stops its own group only,
        which leaves like a failed one and rejoins when relaunched. Each group's own loss rides
        along in its slot (`group_losses`, logged at log steps), and so does its own work's time
        on its last timing step (`group_compute`: data and forward+backward, without the wait
        for the other groups), which names a slow group (`group_times`). One SUM allreduce, and
        one MAX allreduce when there are maxed parts."""
        g, device = self.groups, loss.device
        own = torch.zeros(2 * g, device=device)
        own[self.layout.ft_group] = loss.float().reshape(())
        own[g + self.layout.ft_group] = self.compute_s  # a host float: no device read
        parts = [loss.float().reshape(1), *(t.float().reshape(-1) for t in summed.values()), own]
        packed = torch.cat(parts)
        self.manager.allreduce(packed, reduce_op=ReduceOp.SUM).wait()
        total, *sums, own = packed.split([p.numel() for p in parts])
        self.group_losses, self.group_compute = own.chunk(2)
        if maxed:
            flat = torch.cat([t.float().reshape(-1) for t in maxed.values()])
            self.manager.allreduce(flat, reduce_op=ReduceOp.MAX).wait()
            maxed = dict(zip(maxed, flat.split([t.numel() for t in maxed.values()]), strict=True))
        loss = total.reshape(()) / max(self.manager.num_participants(), 1)
        return loss, dict(zip(summed, sums, strict=True)), maxed

    def average(self, value: torch.Tensor) -> torch.Tensor:
        """A group's mean (an evaluation loss) averaged over the live groups."""
        value = value.detach().clone().float()
        self.manager.allreduce(value).wait()
        return value

    def intact(self) -> bool:
        """Every cross-group reduction of this step so far completed."""
        return self.manager.errored() is None

    def commit(self) -> bool:
        """torchft's vote: apply the step (True) or not anywhere. A committed step counts the
        slices of the groups that did not take part (tokens_skipped_by_group)."""
        if self.resync:  # its weights differed from its peers' after a checkpoint (_differ)
            self.resync = False
            self.manager.report_error(RuntimeError("this group's weights differ from its peers'"))
        if not self.manager.should_commit():
            return False
        state, missing = self.run.counters, set(range(self.groups)) - set(self.participants)
        per_group = self.run.tokens_per_step // self.groups
        for g in sorted(missing):
            key = str(g)
            state.tokens_skipped_by_group[key] = (
                state.tokens_skipped_by_group.get(key, 0) + per_group
            )
        state.tokens_seen -= per_group * len(missing)
        state.samples_seen -= self.run.samples_per_step // self.groups * len(missing)
        step = state.step + 1
        self.last_commit = (step, time.time())
        if self.new_quorum:  # the report's failure costs: the first commit of each membership
            self.new_quorum = False
            self.events.event("quorum_commit", at_step=step, quorum_id=self.quorum_id)
        return True

    def group_times(self) -> dict[int, float]:
        """Each live group's own work on its last timing step (seconds; groups that have not
        timed a step yet are left out), from this step's reduction."""
        if self.group_compute is None:
            return {}
        # Expensive device-to-host synchronization, on timing steps only (the straggler report).
        values = self.group_compute.tolist()
        return {g: values[g] for g in self.participants if values[g] > 0}

    def annotate(self, result: StepOutcome) -> None:
        """At log steps, each live group's own loss (`loss_by_group`): a step whose mean stands
        out shows which group's data or state made it. Once the step time is known, a warning
        when the lighthouse's join timeout is shorter than LATE_STEPS steps."""
        step = result.step
        self.step_times.append(result.step_time)
        if result.step_timing is not None:  # sent with the next steps' reductions
            self.compute_s = result.step_timing["data"] + result.step_timing["forward_backward"]
        if not self.warned_late and len(self.step_times) >= 20:
            median = statistics.median(self.step_times)
            self.warned_late = True
            if LATE_STEPS * median > self.cfg.join_timeout_s:
                self.events.event(
                    "join_timeout_short",
                    join_timeout_s=self.cfg.join_timeout_s,
                    median_step_s=round(median, 3),
                )
                logger.warning(
                    "bigtrain: fault_tolerance.join_timeout_s=%g is shorter than %d median steps "
                    "(%.1f s each): a live group that falls that far behind is left out; raise it",
                    self.cfg.join_timeout_s,
                    LATE_STEPS,
                    median,
                )
        if not self.cadence.is_log_step(step):
            return
        if self.group_losses is None:
            return
        # Expensive device-to-host synchronization, at log steps only (the values are ready:
        # the monitor read its own numbers of the same all-reduce).
        values = self.group_losses.tolist()
        result.telemetry["loss_by_group"] = {str(g): values[g] for g in self.participants}

    def after_step(self, result: StepOutcome) -> None:
        """The policy for a slow group (fault_tolerance.slow_group_leaves_after), from the
        straggler report's `result.slow_groups`, which every group reads alike: the slow group
        leaves (GroupLeft, exit 0) and the others stop waiting for it at the end."""
        after = self.cfg.slow_group_leaves_after
        for group, streak in sorted((result.slow_groups or {}).items()):
            if not after or streak < after or group in self.gone:
                continue
            self.gone.add(group)
            me = group == self.layout.ft_group
            if me or self.leads:
                self.events.event(
                    "group_left",
                    group=group,
                    reason="slow",
                    timing_steps=streak,
                    reported_by=self.layout.ft_group,
                )
            if me:
                raise GroupLeft(f"replica group {group} left the job as the straggler")

    def abandon(self, undo: tuple[dict, dict, dict[str, int]], step: int) -> None:
        """An uncommitted step: nothing of it stays (gradients, data cursor, RNG); it runs again
        with the next quorum."""
        error = self.manager.errored()
        self.reduction_failed = error is not None
        reason = str(error).splitlines()[0] if error is not None else "not committed"
        if error is None and self.manager.num_participants() < self.cfg.min_groups:
            reason = (
                f"{self.manager.num_participants()} groups < fault_tolerance.min_groups "
                f"({self.cfg.min_groups})"
            )
        if error is not None:
            # Close this group's connections now: a peer whose part of a reduction completed
            # may wait in the next one for this group, which skips it after its error (torchft
            # makes every later reduction of the step a no-op), until the process group's
            # timeout (30 s, seen in bench/ft.py's kills). Closed, its wait fails at once.
            # The next quorum configures a new process group.
            self.pg.abort()
        self.run.backend.skip_step()
        self.run.stream.load_state_dict(undo[0])
        set_rng_state(undo[1])
        self.run.counters.transients = undo[2]
        self.events.event("commit_failed", at_step=step, reason=reason[:300])
        logger.warning("bigtrain: step %d not committed (%s): it runs again", step, reason)

    def finish(self) -> None:
        """The end: quorums until every group takes part (a group behind or away catches up from
        a peer in one) or quorum_timeout_s passed, then every group's weights compared. A
        difference is an error event and ReplicaMismatch (exit 7) in every group."""
        deadline = time.monotonic() + self.cfg.quorum_timeout_s
        while True:
            if not self.fresh_quorum:
                self.start_step()
            self.fresh_quorum = False
            done = self._compare(final=True, give_up=time.monotonic() > deadline)
            if done:
                # No group leaves before every group has its comparison: a group that exits
                # while a peer still reads its part of the exchange resets the connection, and
                # that peer would wait alone. This last reduction may fail as they leave.
                self.manager.allreduce(torch.zeros(1, device=self.device)).wait()
                if self.mismatch is not None:
                    raise self.mismatch
                return
            time.sleep(FINISH_POLL_S)

    def _compare(self, final: bool, give_up: bool = False) -> bool:
        """Every live group's weights against the others' (after a persistent checkpoint, and
        at the end). Returns whether the comparison is done: at the end it waits (False) while a
        group is missing, until every group says to give up waiting."""
        key = (self.run.step, self.heals)
        if self.digest is None or self.digest[0] != key:  # the weights changed since the last
            self.digest = (key, local_digest(self.run.backend))
        exchanged = self._exchange(self.digest[1], give_up)
        # Every rank of this group holds its own shard's view; they agree on one verdict.
        views = all_gather_objects(exchanged)
        if any(v is None for v in views):  # a group died during the exchange: ask again
            return False
        weights = weight_groups([v[0] for v in views])
        missing = set(range(self.groups)) - set(weights) - self.gone
        waiting = final and bool(missing) and not any(v[1] for v in views)
        if waiting:
            return False
        odd = odd_groups(weights, self.participants[0] if self.participants else None)
        if final and missing:
            self.events.event("groups_missing", groups=sorted(missing))
        if odd:
            self._differ(weights, odd, final)
        return True

    def _exchange(self, digest: bytes, give_up: bool) -> tuple[dict[int, str], bool] | None:
        """Each live group's digest (this rank's shard) and whether any group gives up waiting:
        one SUM all-reduce across the groups of a row [present, digest bytes] per group and a
        flag. None when the reduction failed."""
        width = 1 + len(digest)
        packed = torch.zeros(self.groups * width + 1, device=self.device)
        row = self.layout.ft_group * width
        packed[row] = 1.0
        packed[row + 1 : row + width] = torch.tensor(list(digest), dtype=torch.float32)
        packed[-1] = float(give_up)
        self.manager.allreduce(packed, reduce_op=ReduceOp.SUM).wait()
        if self.manager.errored() is not None:
            return None
        # Expensive device-to-host synchronization: after checkpoints and at the end only.
        host = packed.tolist()
        digests = {
            g: bytes(round(v) for v in host[g * width + 1 : (g + 1) * width]).hex()
            for g in range(self.groups)
            if host[g * width] > 0
        }
        return digests, host[-1] > 0

    def _differ(self, weights: dict[int, tuple[str, ...]], odd: list[int], final: bool) -> None:
        """Groups hold different weights: an error event in every group. At the end the run
        fails (exit 7); after a checkpoint, the odd groups vote against their next step and take
        a peer's state at the following quorum."""
        shown = {str(g): w[0][:16] for g, w in weights.items()}
        reason = f"replica groups {odd} hold weights that differ from the other groups'"
        self.events.event("error", reason=reason, digests=shown, groups=odd, final=final)
        logger.error("bigtrain: %s (digests of the first rank's shard: %s)", reason, shown)
        if final:  # raised once the groups are through the end (finish)
            if self.run_dir.is_main:
                self.run_dir.differ_marker.write_text(f"{reason}: {shown}\n")
            self.mismatch = ReplicaMismatch(f"{reason}: {shown}")
            return
        # It still takes part in this step's reductions (the others wait for it), but votes
        # against committing it, so that the next quorum finds it behind and heals it.
        self.resync = self.layout.ft_group in odd

    def state_dict(self) -> dict[str, Any]:
        """torchft's step counter and committed batches (checkpoints carry them)."""
        return dict(self.manager.state_dict())

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        if saved:
            self.manager.load_state_dict(saved)

    def close(self) -> None:
        self.manager.shutdown(wait=False)


def _process_age() -> float:
    return round(time.time() - process_start_time(), 3)


def make_replica_groups(
    cfg: FaultToleranceConfig, layout: Layout, device: torch.device
) -> ReplicaGroups | NoReplicaGroups:
    return ReplicaGroups(cfg, layout, device) if layout.ft > 1 else NoReplicaGroups()
