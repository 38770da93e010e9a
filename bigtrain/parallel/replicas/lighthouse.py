"""`bigtrain lighthouse CONFIG`: torchft's lighthouse, which forms the replica groups' quorum of
every step (docs/fault-tolerance.md), with the config's fault_tolerance settings."""

from __future__ import annotations

from bigtrain.config.fault_tolerance import FaultToleranceConfig
from bigtrain.parallel.replicas.connect import quiet_torchft


def serve_lighthouse(cfg: FaultToleranceConfig, port: int) -> int:
    """Run torchft's lighthouse with the config's settings until SIGTERM or Ctrl-C: it forms
    the quorum of every step. Prints `lighthouse http://HOST:PORT` once it listens."""
    import signal
    import threading

    quiet_torchft()
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(
        bind=f"[::]:{port}",
        min_replicas=cfg.min_groups,
        join_timeout_ms=round(cfg.join_timeout_s * 1000),
        quorum_tick_ms=100,
        heartbeat_timeout_ms=round(cfg.heartbeat_timeout_s * 1000),
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"lighthouse {server.address()}", flush=True)
    stop.wait()
    server.shutdown()
    return 0
