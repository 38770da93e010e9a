"""RunState: what a run is at a step boundary, assembled once, used by every copy of it.

A run's state is its backend's tensors (weights, optimizer states: `Backend.local_state`, a host
copy of this rank's shards, and `extra_state`, what the backend keeps beside them), the RNG, and
the parts registered by name, each a `Stateful` (torch DCP's convention: `state_dict()` /
`load_state_dict()`):

    state        the counters (Counters: step, samples, tokens, anomalies, back-off, ...)
    data         the data cursor and skip windows (the stream)
    clip         the adaptive clipping threshold's history
    monitor      the detection rules' windows
    loss_scaler  the loss scale (only with bigtrain's own scaler)
    callbacks    the callbacks' state (INT8 calibration, the straggler streaks, ...)
    replicas     torchft's step and committed batches        (rollback: no)
    local        this rank's own (the suspicion tier's shard history): a file per rank
    resilience   the healer's bookkeeping: targets, ladder   (rollback: no)

Three copies are made of it, all here, so that a part registered once is in each:
  - a checkpoint: `state_dict()` beside the tensors (checkpoint/manager.py writes trainer.json,
    `local` per rank, the RNG per rank, the tensors through DCP);
  - a rejoining replica group's transfer: `peer_state()`, the same parts with the tensors, the
    RNG and the rollback snapshots held in memory (`memory` parts), as host copies;
  - a rollback snapshot: `hold()`, the parts a rollback restores (`rollback=True`), the tensors
    and the RNG. A rollback restores what the run trains with, not the healer's own bookkeeping
    or torchft's step count, which only grows.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Protocol

from bigtrain.checkpoint.rng import rng_state, set_rng_state
from bigtrain.data.read.stream import SampleStream
from bigtrain.parallel.backends.base import Backend

LOCAL = "local"
"""The part that is this rank's own: checkpoints write it per rank, and a run at another world
size starts it empty."""


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class Counters:
    """The run's counters (the data cursor lives in the stream)."""

    step: int = 0
    samples_seen: int = 0
    tokens_seen: int = 0
    skipped_steps: int = 0
    anomalies: int = 0
    rollbacks: int = 0
    last_loss: float = float("nan")  # the last step's loss (mean over ranks)
    lr_scale: float = 1.0  # < 1 after a rollback, until backoff_until
    clip_scale: float = 1.0  # the clipping threshold's factor, likewise
    backoff_until: int = 0  # step the back-off ends at; 0: none, -1: for the rest of the run
    transients: dict[str, int] = field(default_factory=dict)  # transient faults by host (replay)
    # replica groups (parallel/replicas/groups.py): tokens of the steps a group missed, by group
    tokens_skipped_by_group: dict[str, int] = field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """In place (every holder of this object sees the loaded counters); a field the saved
        state lacks (an earlier bigtrain's) takes its default."""
        loaded = Counters(**state)
        for f in fields(self):
            setattr(self, f.name, getattr(loaded, f.name))


@dataclass(frozen=True)
class Cadence:
    """When a run does what, as the parts acting on it need to know: its last step, its log
    steps, its checkpoint steps."""

    end_step: int
    log_every: int
    checkpoint_every: int

    def is_log_step(self, step: int) -> bool:
        return step % self.log_every == 0 or step >= self.end_step


@dataclass
class Held:
    """A host copy of the state a rollback restores: this rank's tensors, the parts, the RNG."""

    backend_state: dict[str, Any]
    parts: dict[str, Any]
    rng: dict[str, Any]


@dataclass
class _Part:
    obj: Stateful
    rollback: bool
    missing: dict[str, Any] | None
    """What loads when a saved state lacks the part (an earlier bigtrain's checkpoint, another
    world size's `local`); None: the part stays as it is."""


class RunState:
    """The run's state (module docstring). `backend`, `counters` and `stream` are the parts
    everything reads; `samples_per_step` and `tokens_per_step` what one step consumes."""

    def __init__(
        self,
        backend: Backend,
        counters: Counters,
        stream: SampleStream,
        samples_per_step: int,
        tokens_per_step: int,
    ) -> None:
        self.backend, self.counters, self.stream = backend, counters, stream
        self.samples_per_step, self.tokens_per_step = samples_per_step, tokens_per_step
        self.parts: dict[str, _Part] = {}
        self.memory: dict[str, Stateful] = {}
        self.add("state", counters)
        self.add("data", stream)

    @property
    def step(self) -> int:
        return self.counters.step

    def add(
        self,
        name: str,
        obj: Stateful,
        rollback: bool = True,
        missing: dict[str, Any] | None = None,
    ) -> None:
        """Register a part: checkpoints, transfers and (with `rollback`) snapshots take it."""
        assert name not in self.parts, f"part {name!r} registered twice"
        self.parts[name] = _Part(obj, rollback, missing)

    def add_memory(self, name: str, obj: Stateful) -> None:
        """Register what only host memory holds (the rollback targets' snapshots): a rejoining
        group receives it with the state; checkpoints cannot carry it."""
        self.memory[name] = obj

    def state_dict(self, rollback_only: bool = False) -> dict[str, Any]:
        """Every part's state by name (`rollback_only`: those a rollback restores)."""
        return {
            name: part.obj.state_dict()
            for name, part in self.parts.items()
            if part.rollback or not rollback_only
        }

    def load_state_dict(self, saved: dict[str, Any], rollback_only: bool = False) -> None:
        """Load each part from `saved`, in registration order (the detector's windows before
        this rank's own shard history, which may reset its suspicion tier)."""
        for name, part in self.parts.items():
            if rollback_only and not part.rollback:
                continue
            state = saved.get(name)
            if state is None:
                state = copy.deepcopy(part.missing)
            if state is not None:
                part.obj.load_state_dict(state)

    def hold(self) -> Held:
        """A host copy of what a rollback restores (pinned, non-blocking on CUDA:
        Backend.local_state)."""
        tensors = self.backend.local_state()
        return Held(tensors, copy.deepcopy(self.state_dict(rollback_only=True)), rng_state())

    def load_held(self, held: Held) -> None:
        self.backend.load_local_state(held.backend_state)
        self.load_state_dict(copy.deepcopy(held.parts), rollback_only=True)
        set_rng_state(held.rng)

    def peer_state(self) -> dict[str, Any]:
        """What a rejoining replica group receives: every part, the tensors and what the backend
        keeps beside them, the RNG, and the memory parts, as host copies made now."""
        return {
            "tensors": self.backend.local_state(),
            "backend_extra": self.backend.extra_state(),
            "parts": copy.deepcopy(self.state_dict()),
            "rng": rng_state(),
            "memory": {name: obj.state_dict() for name, obj in self.memory.items()},
        }

    def load_peer_state(self, state: dict[str, Any]) -> None:
        """Put a peer's state in place, as loading a checkpoint of it would."""
        self.backend.load_local_state(state["tensors"])
        self.backend.load_extra_state(state["backend_extra"])
        self.load_state_dict(state["parts"])
        for name, obj in self.memory.items():
            obj.load_state_dict(state["memory"].get(name, {}))
        set_rng_state(state["rng"])
