"""Rank 0's console lines (telemetry/console.py): every event the console shows is one formatted
line, checkpoints named by their own step, steps with elapsed time, ETA and MFU."""

from __future__ import annotations

import pytest

from bigtrain.telemetry.console import FORMATS, duration, event_line, step_line

pytestmark = pytest.mark.unit

SAMPLES = {
    "checkpoint": {
        "path": "runs/x/checkpoints/step_00000100",
        "seconds": 0.2,
        "stall_s": 0.0412,
        "async": True,
        "write_s": 0.19,
        "bytes_per_rank": [13545531, 13000000],
    },
    "resume": {
        "path": "runs/x/checkpoints/step_00000012",
        "changed": ["train.max_steps"],
        "changes": {"train.max_steps": [12, 500], "data.paths": [["a.txt"], ["b.txt"]]},
        "identity_changed": [],
        "batch": "global batch kept at 16 sequences on 2 data-parallel ranks",
    },
    "anomaly": {
        "type": "spike",
        "metric": "loss",
        "value": 50.0,
        "threshold": 5.0,
        "baseline": 2.0,
        "tensor": "lm_head.weight",
        "top_jumps": [["lm_head.weight", 12.0]],
        "action": "rollback",
    },
    "rollback": {
        "from_step": 30,
        "to_step": 20,
        "source": "memory",
        "replay_steps": 0,
        "rollbacks": 1,
    },
    "replay": {"verdict": "transient", "rank": 1, "metric": "grads", "seconds": 0.31},
    "profile": {"rank": 0, "steps": [4, 5], "trace": "runs/x/profile/rank0.4.pt.trace.json"},
    "checkpoint_invalid": {"path": "runs/x/checkpoints/step_00000010", "reason": "sha256 mismatch"},
    "checkpoint_refused": {"reason": "3 non-finite state values"},
    "skip_data": {"start": 80, "end": 168, "samples": 88},
    "lr_backoff": {"factor": 0.5, "lr_scale": 0.5, "clip_scale": 0.5, "until_step": 40},
    "lr_restore": {"lr_scale": 1.0, "after": 0.5},
    "abort": {"reason": "3 anomalous steps in a row"},
    "preempt": {"reason": "SIGTERM at step 7", "checkpoint_step": 7},
    "straggler": {
        "rank": 1,
        "part": "forward_backward",
        "seconds": 0.9,
        "others_median_s": 0.3,
        "ratio": 3.0,
    },
    "group_left": {"group": 2, "reason": "late", "waited_s": 60.2, "reported_by": 0},
    "hang": {"rank": 1, "waited_s": 301.2, "stacks": "runs/x/hang/rank_1.txt"},
    "host_excluded": {"host": "node7", "rank": 1, "transients": 3},
    "source_exhausted": {"source": "code", "position": 4096, "epochs": 2, "samples": 2048},
}


def test_every_event_the_console_shows_is_one_formatted_line():
    assert set(SAMPLES) == set(FORMATS)
    for kind, details in SAMPLES.items():
        line = event_line({"time": 1.0, "step": 101, "kind": kind, **details})
        assert line and "\n" not in line, kind
        assert not any(c in line for c in "{}[]") and "': " not in line, line
    assert event_line({"time": 1.0, "step": 3, "kind": "startup"}) is None  # files only


def test_a_checkpoint_is_named_by_its_own_step_and_its_size_per_rank():
    record = {"time": 1.0, "step": 101, "kind": "checkpoint", **SAMPLES["checkpoint"]}
    assert event_line(record) == (
        "checkpoint step 100 -> runs/x/checkpoints/step_00000100 (13.5 MB/rank, stall 0.04 s, "
        "written in the background, committed at step 101)"
    )
    synchronous = {**record, "step": 100, "async": False}
    assert event_line(synchronous).endswith("(13.5 MB/rank, stall 0.04 s)")


def test_a_resume_says_what_changed_and_how_the_batch_was_kept():
    line = event_line({"time": 1.0, "step": 12, "kind": "resume", **SAMPLES["resume"]})
    assert line == (
        "resume from runs/x/checkpoints/step_00000012 (step 12); config changed: "
        "train.max_steps 12 -> 500; data.paths a.txt -> b.txt; global batch kept at 16 "
        "sequences on 2 data-parallel ranks"
    )


def test_a_step_line_has_elapsed_time_eta_and_mfu_where_known():
    record = {"step": 200, "loss": 5.12345, "lr": 9e-4, "tokens_per_s": 12345.6, "mfu": 0.312}
    assert step_line({**record, "val_loss": 5.2}, 500, 70.2, 105.4) == (
        "step 200/500  loss 5.1235  val 5.2000  lr 9.00e-04  12,346 tok/s  mfu 31.2%  "
        "0:01:10 elapsed  eta 0:01:45"
    )
    without = {k: v for k, v in record.items() if k != "mfu"}
    assert "mfu" not in step_line(without, 500, 1.0)
    assert duration(3725) == "1:02:05" and duration(-3) == "0:00:00"
