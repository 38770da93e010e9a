"""How a replica group connects to torchft: which group this process is (BIGTRAIN_FT_GROUP), the
lighthouse's address and a check that it answers, torchft's logging kept to warnings, the process
group and checkpoint transport a group's Manager uses, a fresh store of its own, and the wrappers
that keep the last quorum and time what a peer sent."""

from __future__ import annotations

import logging
import os
import socket
import time
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import torch

from bigtrain.config.fault_tolerance import FaultToleranceConfig
from bigtrain.errors import ConfigError, SharedConfigError
from bigtrain.parallel.layout import Layout
from bigtrain.utils.clock import nested_bytes
from bigtrain.utils.dist import all_gather_objects

GROUP_ENV = "BIGTRAIN_FT_GROUP"
"""The environment variable that tells a process which replica group it belongs to."""


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


def unreachable(address: str, timeout_s: float) -> str | None:
    """Why the lighthouse at `address` (http://host:port) cannot be reached, or None: one TCP
    connection, so that a wrong address fails at once instead of after torchft's retries."""
    url = urlparse(address if "://" in address else f"http://{address}")
    if not url.hostname or url.port is None:
        return "is not http://HOST:PORT"
    try:
        with socket.create_connection((url.hostname, url.port), timeout=timeout_s):
            return None
    except OSError as e:
        return f"cannot be reached ({e.strerror or e})"


def check_lighthouse(cfg: FaultToleranceConfig, layout: Layout) -> None:
    """Rank 0 of the group (the one that talks to the lighthouse) tries it; every rank of the
    group raises the same error when it cannot be reached."""
    address = lighthouse_address(cfg)
    reason = unreachable(address, min(cfg.timeout_s, 10.0)) if layout.rank == 0 else None
    reason = all_gather_objects(reason)[0]
    if reason is not None:
        source = "key 'fault_tolerance.lighthouse'" if cfg.lighthouse else "TORCHFT_LIGHTHOUSE"
        raise SharedConfigError(
            f"the torchft lighthouse {address} ({source}) {reason}: start one (bigtrain "
            "lighthouse CONFIG; launch/ft.sh and slurm/ft.sbatch start it) and pass its address"
        )


class Recorded:
    """torchft's ManagerClient, with the last quorum's result kept (who takes part)."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.last: Any = None

    def _quorum(self, **kwargs: Any) -> Any:
        self.last = self.client._quorum(**kwargs)
        return self.last

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


class TimedTransport:
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
    manager_log = logging.getLogger("torchft.manager")
    if not any(isinstance(f, NoFlightRecorderNote) for f in manager_log.filters):
        manager_log.addFilter(NoFlightRecorderNote())


class NoFlightRecorderNote(logging.Filter):
    """torchft warns at every new quorum that it cannot reset NCCL's flight recorder when the
    torch build has no NCCL (CPU groups on gloo): nothing is lost there, so the line goes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Unable to reset NCCL flight recorder" not in record.getMessage()


def process_group(timeout: timedelta, device: torch.device) -> Any:
    from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

    return ProcessGroupNCCL(timeout) if device.type == "cuda" else ProcessGroupGloo(timeout)


def transport(cfg: FaultToleranceConfig, pg: Any, device: torch.device) -> Any:
    from torchft.checkpointing import HTTPTransport
    from torchft.checkpointing.pg_transport import PGTransport

    timeout = timedelta(seconds=cfg.timeout_s)
    if cfg.transport == "pg":
        return PGTransport(pg, timeout=timeout, device=device)
    return HTTPTransport(timeout=timeout, num_chunks=0)


def group_ids(replica_ids: list[str]) -> list[int]:
    """Replica group indices from torchft's replica ids (`group<g>:<uuid>`), sorted."""
    return sorted(int(r.split(":")[0].removeprefix("group")) for r in replica_ids)


def own_store(layout: Layout) -> tuple[str, int, Any]:
    """A fresh TCPStore for torchft's manager of this group (rank 0 serves it; its port is shared
    over the group's process group): a restarted group never reads a dead attempt's addresses,
    which torchrun's store, kept across restarts, would still hold."""
    from torch.distributed import TCPStore

    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    server = TCPStore(host, 0, is_master=True, wait_for_workers=False) if layout.rank == 0 else None
    port = all_gather_objects(server.port if server is not None else None)[0]
    return host, port, server
