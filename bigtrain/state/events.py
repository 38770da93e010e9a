"""Where the parts that act on a run write what they did: the event sink's one method."""

from __future__ import annotations

from typing import Any, Protocol


class Events(Protocol):
    """Writes an event (events.jsonl on rank 0, and every callback hears it: console, wandb).
    The trainer is the run's sink; tests record them."""

    def event(self, kind: str, at_step: int | None = None, **details: Any) -> dict[str, Any]:
        """`at_step`: the step the event belongs to where the state no longer tells (a rollback's
        events carry the anomaly's step); by default the step in progress, or the last one."""
        ...
