"""Logging: one `logging` logger per module (`logging.getLogger(__name__)`), under "bigtrain".

The CLI calls `setup_console` once: rank 0's records go to stdout as plain lines, the other ranks'
warnings to stderr with their rank. A run adds `RUN_DIR/logs/rank_<r>.log` for every rank
(`add_rank_file`, removed when the run ends). Used as a library (tests, notebooks) nothing is
printed but warnings, and the run's log files are still written.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import TextIO

ROOT = "bigtrain"


def setup_console(rank: int, stream: TextIO | None = None) -> None:
    """Console output for this process (once, by the CLI). `stream`: where rank 0's records go
    (default stdout; stderr for a command whose stdout is its result)."""
    logger = logging.getLogger(ROOT)
    logger.setLevel(logging.INFO)
    if any(getattr(h, "bigtrain_console", False) for h in logger.handlers):
        return
    if rank == 0:
        handler: logging.Handler = logging.StreamHandler(stream or sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setLevel(logging.WARNING)
        handler.setFormatter(logging.Formatter(f"[rank {rank}] %(levelname)s %(message)s"))
    handler.bigtrain_console = True  # type: ignore[attr-defined]
    logger.addHandler(handler)


def rank_log_file(logs: Path, rank: int) -> Path:
    """LOGS/rank_<rank>.log (LOGS: RUN_DIR/logs, with replica groups RUN_DIR/logs/group<g>)."""
    return logs / f"rank_{rank}.log"


def add_rank_file(logs: Path, rank: int) -> logging.Handler:
    """Every record of this rank from now on to its rank_log_file."""
    logs.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(rank_log_file(logs, rank))
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%Y-%m-%d %H:%M:%S")
    )
    logger = logging.getLogger(ROOT)
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    return handler


def remove_handler(handler: logging.Handler | None) -> None:
    if handler is not None:
        logging.getLogger(ROOT).removeHandler(handler)
        handler.close()
