"""Fault-tolerant replica groups on torchft: the outermost data-parallel dimension (Layout.ft),
made of separate jobs that may die and rejoin while the others keep training.

Each step, in every group (the loop calls these by name; NoReplicaGroups, for a run without
groups, does nothing):

    start_step   a quorum from the lighthouse (torchft Manager.start_quorum, synchronous): who
                 takes part. A group that is behind (restarted, or it failed to commit) receives
                 the whole state from a live peer here, before it reads its data: weights,
                 optimizer, trainer counters and LR back-off, the healer's targets and windows,
                 loss scale, the data cursor and RNG (`peer_state` / `load_peer_state`).
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

A rollback is a committed step whose outcome loads a target: torchft's step counter only grows,
so a group that joins during or after it receives the rolled-back state. Persistent checkpoints
are written by the quorum's first group (`leads`); every group writes its own events.
"""

from __future__ import annotations

import copy
import logging
import os
import time
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import ReduceOp

from bigtrain.checkpoint.rng import rng_state, set_rng_state
from bigtrain.config.fault_tolerance import FaultToleranceConfig
from bigtrain.errors import ConfigError
from bigtrain.parallel.layout import Layout
from bigtrain.utils.clock import nested_bytes, process_start_time
from bigtrain.utils.tensors import local_tensor

logger = logging.getLogger(__name__)

GROUP_ENV = "BIGTRAIN_FT_GROUP"
"""The environment variable that tells a process which replica group it belongs to."""
BUCKET_ELEMENTS = 1 << 24
"""Gradient elements per cross-group all-reduce (64 MB of FP32): few collectives, bounded copies."""


def group_index(groups: int) -> int:
    """This process's replica group, from BIGTRAIN_FT_GROUP (0 without groups)."""
    if groups == 1:
        return 0
    value = os.environ.get(GROUP_ENV)
    if value is None or not value.isdigit() or not 0 <= int(value) < groups:
        raise ConfigError(
            f"key 'fault_tolerance.groups' is {groups}, so each process needs {GROUP_ENV} set to "
            f"its replica group (0..{groups - 1}), got {value!r}: launch with launch/ft.sh or "
            "slurm/ft.sbatch"
        )
    return int(value)


def lighthouse_address(cfg: FaultToleranceConfig) -> str:
    address = cfg.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "")
    if not address:
        raise ConfigError(
            "key 'fault_tolerance.lighthouse' is empty and TORCHFT_LIGHTHOUSE is not set: "
            "replica groups need the lighthouse's address (launch/ft.sh starts one)"
        )
    return address


class NoReplicaGroups:
    """A run without replica groups: one job; every call leaves the step as it is."""

    groups = 1
    leads = True
    across_groups = None  # the monitor's numbers need no reduction across groups

    def attach(self, trainer) -> None:
        """No peer ever asks for the state."""

    def start_step(self, trainer) -> None:
        """Nothing to agree on."""

    def undo_point(self, trainer) -> None:
        return None

    def average_grads(self, backend) -> None:
        """The backend reduced the gradients over the job already."""

    def average(self, value: torch.Tensor) -> torch.Tensor:
        return value

    def intact(self) -> bool:
        return True

    def commit(self, trainer) -> bool:
        return True

    def abandon(self, trainer, undo: None, step: int) -> None:
        raise AssertionError("a run without replica groups commits every step")

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Nothing saved."""

    def close(self) -> None:
        """Nothing to shut down."""


def peer_state(trainer) -> dict[str, Any]:
    """What a rejoining group takes from a live one: everything a checkpoint holds, and the
    rollback targets' snapshots this group holds in memory (a later rollback must restore the
    same state in every group, from the same source), as host copies made now. torchft calls
    this on its quorum thread while the loop waits for the quorum; on CUDA the device is
    synchronized before (the last step's kernels) and after (the copies) so that no half-copied
    tensor is sent."""
    backend, targets = trainer.backend, trainer.healer.targets
    synchronize(trainer.device)
    state = {
        "backend": backend.local_state(),
        "backend_extra": backend.extra_state(),
        "trainer": copy.deepcopy(trainer.trainer_state(resilience=True)),
        "rng": rng_state(),
        "held": {t.step: t.held for t in (targets.start, *targets.ring) if t.held is not None},
    }
    synchronize(trainer.device)
    return state


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def load_peer_state(trainer, state: dict[str, Any]) -> None:
    """Put a peer's state in place, as loading a checkpoint of it would (the data cursor is the
    peer's; this group reads its own slice of the same global batches)."""
    trainer.backend.load_local_state(state["backend"])
    trainer.backend.load_extra_state(state["backend_extra"])
    trainer.load_trainer_state(state["trainer"], resilience=True)
    targets = trainer.healer.targets
    for target in (targets.start, *targets.ring):
        target.held = state["held"].get(target.step)
    set_rng_state(state["rng"])


class _Recorded:
    """torchft's ManagerClient, with the last quorum's result kept (who takes part)."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.last: Any = None

    def _quorum(self, **kwargs: Any) -> Any:
        self.last = self.client._quorum(**kwargs)
        return self.last

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


class _TimedTransport:
    """A checkpoint transport that measures what it received (seconds, bytes)."""

    def __init__(self, transport: Any) -> None:
        self.transport, self.received_s, self.received_bytes = transport, 0.0, 0

    def recv_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        state = self.transport.recv_checkpoint(*args, **kwargs)
        self.received_s = time.perf_counter() - started
        self.received_bytes = nested_bytes(state)
        return state

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


def quiet_torchft() -> None:
    """torchft's Rust side logs every quorum and commit at INFO on stderr: warnings only, unless
    the user set RUST_LOG (before torchft is imported: its logger reads it once). ConfigError
    when torchft is not installed."""
    import importlib.util

    if importlib.util.find_spec("torchft") is None:
        raise ConfigError(
            "key 'fault_tolerance.groups' is above 1, which needs torchft: "
            "pip install 'bigtrain[ft]' (torchft==0.2.0)"
        )
    os.environ.setdefault("RUST_LOG", "warn")
    for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
        logging.getLogger(name).setLevel(logging.WARNING)


def _process_group(timeout: timedelta, device: torch.device) -> Any:
    from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

    return ProcessGroupNCCL(timeout) if device.type == "cuda" else ProcessGroupGloo(timeout)


def _transport(cfg: FaultToleranceConfig, pg: Any, device: torch.device) -> Any:
    from torchft.checkpointing import HTTPTransport
    from torchft.checkpointing.pg_transport import PGTransport

    timeout = timedelta(seconds=cfg.timeout_s)
    if cfg.transport == "pg":
        return PGTransport(pg, timeout=timeout, device=device)
    return HTTPTransport(timeout=timeout, num_chunks=0)


def group_ids(replica_ids: list[str]) -> list[int]:
    """Replica group indices from torchft's replica ids (`group<g>:<uuid>`), sorted."""
    return sorted(int(r.split(":")[0].removeprefix("group")) for r in replica_ids)


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


def _own_store(layout: Layout) -> tuple[str, int, Any]:
    """A fresh TCPStore for torchft's manager of this group (rank 0 serves it; its port is shared
    over the group's process group): a restarted group never reads a dead attempt's addresses,
    which torchrun's store, kept across restarts, would still hold."""
    from torch.distributed import TCPStore

    from bigtrain.utils.dist import all_gather_objects

    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    server = TCPStore(host, 0, is_master=True, wait_for_workers=False) if layout.rank == 0 else None
    port = all_gather_objects(server.port if server is not None else None)[0]
    return host, port, server


class ReplicaGroups:
    """This group's torchft Manager and what the loop asks of it (module docstring)."""

    def __init__(self, cfg: FaultToleranceConfig, layout: Layout, device: torch.device) -> None:
        quiet_torchft()
        from torchft.manager import Manager

        self.cfg, self.layout, self.groups = cfg, layout, layout.ft
        timeout = timedelta(seconds=cfg.timeout_s)
        pg = _process_group(timeout, device)
        self.transport = _TimedTransport(_transport(cfg, pg, device))
        host, port, self._store = _own_store(layout)
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
        self.client = _Recorded(self.manager._client)
        self.manager._client = self.client  # type: ignore[assignment]
        self.participants: list[int] = []
        self.quorum_id: int | None = None
        self.leads = False  # until the first quorum says who leads

    def attach(self, trainer) -> None:
        """The trainer whose state a peer receives and a rejoining group loads."""
        self.manager.register_state_dict_fn(
            "bigtrain", lambda state: load_peer_state(trainer, state), lambda: peer_state(trainer)
        )

    def start_step(self, trainer) -> None:
        """The quorum of this step; a group behind the others loads a live peer's state here."""
        quorum = self._quorum()
        participants = group_ids(quorum.replica_ids)
        self.leads = trainer.run_dir.leader = self.manager.participating_rank() == 0
        if quorum.quorum_id != self.quorum_id:  # a membership change (a group replaced too)
            self.quorum_id = quorum.quorum_id
            trainer.event(
                "quorum",
                at_step=trainer.state.step + 1,
                participants=participants,
                groups=len(participants),
                quorum_id=quorum.quorum_id,
            )
            self.participants = participants
        if quorum.heal and self.manager.errored() is None:
            trainer.event(
                "group_joined",
                at_step=trainer.state.step + 1,
                group=self.layout.ft_group,
                seconds=round(time.time() - process_start_time(), 3),
                transfer_s=round(self.transport.received_s, 4),
                bytes=self.transport.received_bytes,
                source=quorum.recover_src_replica_rank,
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

    def undo_point(self, trainer) -> tuple[dict[str, Any], dict[str, Any], dict[str, int]]:
        """The data cursor, RNG and transient-fault counts before the step: an uncommitted step
        puts them back (its replay, if it had one, runs again with it)."""
        stream = copy.deepcopy(trainer.loader.stream.state_dict())
        return stream, rng_state(), dict(trainer.state.transients)

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
        self, loss: torch.Tensor, flags: torch.Tensor, maxima: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The loss averaged over the live groups (the numbers that differ between groups: the
        gradients were averaged before the monitor read them), the HSDP probe's flags and MoE
        router sums summed (replicas that differ in one group make every group act), and the
        router extremes (`maxima`, zeros neutral: a group that sits out sends zeros) maxed. The
        first flag, a preemption signal, stays the group's: it stops its own group only, which
        leaves like a failed one and rejoins when relaunched."""
        flags = flags.float().reshape(-1)
        packed = torch.cat([loss.float().reshape(1), flags[1:]])
        self.manager.allreduce(packed, reduce_op=ReduceOp.SUM).wait()
        if maxima is not None:
            maxima = maxima.float().clone()
            self.manager.allreduce(maxima, reduce_op=ReduceOp.MAX).wait()
        loss = packed[0] / max(self.manager.num_participants(), 1)
        return loss, torch.cat([flags[:1], packed[1:]]), maxima

    def average(self, value: torch.Tensor) -> torch.Tensor:
        """A group's mean (an evaluation loss) averaged over the live groups."""
        value = value.detach().clone().float()
        self.manager.allreduce(value).wait()
        return value

    def intact(self) -> bool:
        """Every cross-group reduction of this step so far completed."""
        return self.manager.errored() is None

    def commit(self, trainer) -> bool:
        """torchft's vote: apply the step (True) or not anywhere. A committed step counts the
        slices of the groups that did not take part (tokens_skipped_by_group)."""
        if not self.manager.should_commit():
            return False
        state, missing = trainer.state, set(range(self.groups)) - set(self.participants)
        per_group = trainer.tokens_per_step // self.groups
        for g in sorted(missing):
            key = str(g)
            state.tokens_skipped_by_group[key] = (
                state.tokens_skipped_by_group.get(key, 0) + per_group
            )
        state.tokens_seen -= per_group * len(missing)
        state.samples_seen -= trainer.loader.global_batch_size // self.groups * len(missing)
        return True

    def abandon(self, trainer, undo: tuple[dict, dict, dict[str, int]], step: int) -> None:
        """An uncommitted step: nothing of it stays (gradients, data cursor, RNG); it runs again
        with the next quorum."""
        error = self.manager.errored()
        reason = str(error).splitlines()[0] if error is not None else "not committed"
        if error is None and self.manager.num_participants() < self.cfg.min_groups:
            reason = (
                f"{self.manager.num_participants()} groups < fault_tolerance.min_groups "
                f"({self.cfg.min_groups})"
            )
        trainer.backend.skip_step()
        trainer.loader.stream.load_state_dict(undo[0])
        set_rng_state(undo[1])
        trainer.state.transients = undo[2]
        trainer.event("commit_failed", at_step=step, reason=reason[:300])
        logger.warning("bigtrain: step %d not committed (%s): it runs again", step, reason)

    def state_dict(self) -> dict[str, Any]:
        """torchft's step counter and committed batches (checkpoints carry them)."""
        return dict(self.manager.state_dict())

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        if saved:
            self.manager.load_state_dict(saved)

    def close(self) -> None:
        self.manager.shutdown(wait=False)


def make_replica_groups(
    cfg: FaultToleranceConfig, layout: Layout, device: torch.device
) -> ReplicaGroups | NoReplicaGroups:
    return ReplicaGroups(cfg, layout, device) if layout.ft > 1 else NoReplicaGroups()
