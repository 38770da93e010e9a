"""The spawned-ranks harness (tests/distributed.py): a failing rank ends the run at once, and a
rendezvous port taken by another process is tried again on a new one."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.distributed import run_distributed

pytestmark = pytest.mark.distributed


def _rank_1_fails(_marker: str) -> int:
    if os.environ["RANK"] == "1":
        raise ValueError("rank 1 broke")
    time.sleep(120)  # the others would wait in their next collective
    return 0


def _port_taken_once(marker: str) -> int:
    path = Path(marker)
    if os.environ["RANK"] == "0" and not path.exists():
        path.write_text("taken")
        raise RuntimeError("failed to listen on any local network address: EADDRINUSE")
    return int(os.environ["RANK"])


def test_a_failing_rank_ends_the_others_at_once(tmp_path):
    began = time.monotonic()
    with pytest.raises(AssertionError) as e:
        run_distributed(_rank_1_fails, 2, str(tmp_path / "m"))
    assert time.monotonic() - began < 60
    assert "rank 1 broke" in str(e.value) and "ended after rank 1 failed" in str(e.value)


def test_a_taken_rendezvous_port_is_tried_again(tmp_path):
    marker = tmp_path / "m"
    assert run_distributed(_port_taken_once, 2, str(marker)) == [0, 1]
    assert marker.read_text() == "taken"
