"""Which logged records a run kept, and which it abandoned by rolling back or resuming.

A rollback restores an older state and trains its steps again; so does a resume from a checkpoint
older than the last logged step. metrics.jsonl is append-only, so it then holds the same steps
twice: the abandoned ones, then the replayed ones. Read in file order, a record whose step is <= the
step of an earlier record starts a replay, and every earlier record still kept with a step >= its
step was abandoned. What remains is strictly increasing in step: the trajectory whose weights the
run carried on with.

Records alone cannot see a rollback whose replay logs nothing at or before the last abandoned step
(an anomaly at step 33 logged between log steps 30 and 35, rolled back to 30: the replay's first
record is 35, so 33 stays kept). The rollback event's `to_step` says so; this rule does not read it.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

Record = TypeVar("Record", bound=Mapping[str, Any])


def split_trajectory(records: Sequence[Record]) -> tuple[list[Record], list[list[Record]]]:
    """(kept, abandoned segments) of `records` (each with a "step"), in file order.

    `kept` is strictly increasing in step. Each abandoned segment is the run of kept records that
    one replay cut off, so it is strictly increasing too; segments are listed in the order they
    were cut. A replay that goes back past an earlier replay cuts records of both into one
    segment."""
    kept: list[Record] = []
    kept_steps: list[int] = []  # kept's steps, for bisect
    abandoned: list[list[Record]] = []
    for record in records:
        step = record["step"]
        if kept_steps and step <= kept_steps[-1]:
            cut = bisect.bisect_left(kept_steps, step)
            abandoned.append(kept[cut:])
            del kept[cut:], kept_steps[cut:]
        kept.append(record)
        kept_steps.append(step)
    return kept, abandoned
