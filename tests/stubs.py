"""A stub trainer for unit tests of callbacks (OLMo-core tests its callbacks with a mock trainer).

It has what callbacks touch on a Trainer, with small real parts where they are cheap: the real
Counters and RunState, SampleStream, RunDir (events.jsonl under a temporary directory), Callbacks, and the
real Trainer's `step` and `event` (so events carry the step numbers a run would give them). The
backend's whole state is one weight vector that every applied step adds 1 to: after a restore
it tells which step's state was loaded. No model, no loop, no process group.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bigtrain.checkpoint.manifest import PREFIX, CheckpointError
from bigtrain.config.schema import Config
from bigtrain.data.read.stream import SampleStream
from bigtrain.parallel.env import DistEnv
from bigtrain.parallel.replicas.groups import NoReplicaGroups
from bigtrain.precision.scaler import ScaleUpdate
from bigtrain.resilience import Anomaly, Healer
from bigtrain.state.run import Counters, RunState
from bigtrain.store.rundir import RunDir
from bigtrain.train import Trainer
from bigtrain.train.hooks import Callback, Callbacks
from bigtrain.train.step import StepResult

GLOBAL_BATCH = 4  # samples per step: step s ends with the stream's cursor at s * GLOBAL_BATCH


def nonfinite(metric: str = "grads") -> Anomaly:
    return Anomaly("nonfinite", metric, float("nan"), tensor="lm_head.weight")


def spike(metric: str = "loss") -> Anomaly:
    return Anomaly("spike", metric, 50.0, threshold=5.0, baseline=2.0)


class StubBackend:
    """Backend.local_state/load_local_state over one weight vector, and gradients by name. The
    first gradient is empty: this rank holds no part of it (a sharded backend's view)."""

    scaler = None

    def __init__(self) -> None:
        self.weight = torch.zeros(3)
        self.grads = {
            "wte.weight": torch.empty(0),
            "blocks.0.attn.qkv.weight": torch.full((2, 3), 2.0),
            "lm_head.weight": torch.full((4,), 3.0),
        }

    def named_grads(self) -> list[tuple[str, torch.Tensor]]:
        return list(self.grads.items())

    def local_state(self) -> dict[str, Any]:
        return {"weight": self.weight.clone()}

    def load_local_state(self, state: dict[str, Any]) -> None:
        self.weight.copy_(state["weight"])  # in place, as Backend.load_local_state


class StubMonitor:
    """The monitor as the healer uses it between steps: a kept step's shard levels (none here)."""

    def accept(self, health: object) -> None:
        """No shard history."""


class StubLoader:
    def __init__(self, stream: SampleStream, global_batch_size: int) -> None:
        self.stream, self.global_batch_size = stream, global_batch_size


class StubManager:
    """CheckpointManager as rollback uses it: committed checkpoints (kept in memory, keyed by
    step), verify (raises for the ones in `corrupt`), load, retire_after, finish_pending."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.saved: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {}
        self.corrupt: set[int] = set()
        self.calls: list[tuple] = []

    def save(self, trainer: StubTrainer) -> None:
        state = (trainer.backend.local_state(), copy.deepcopy(trainer.run.state_dict()))
        self.saved[trainer.step] = state

    def path(self, step: int) -> Path:
        return self.root / f"{PREFIX}{step:08d}"

    def committed(self) -> list[Path]:
        return [self.path(step) for step in sorted(self.saved)]

    def verify(self, path: Path) -> dict[str, Any]:
        self.calls.append(("verify", path.name))
        step = int(path.name[len(PREFIX) :])
        if step in self.corrupt:
            raise CheckpointError(f"{path}: sha256 mismatch")
        return {"step": step}

    def load(self, path: Path, backend: StubBackend) -> dict[str, Any]:
        self.calls.append(("load", path.name))
        backend_state, trainer_state = self.saved[int(path.name[len(PREFIX) :])]
        backend.load_local_state(backend_state)
        return copy.deepcopy(trainer_state)

    def finish_pending(self) -> None:
        self.calls.append(("finish_pending",))

    def retire_after(self, step: int) -> list[str]:
        self.calls.append(("retire_after", step))
        newer = [s for s in self.saved if s > step]
        for s in newer:
            del self.saved[s]
        return [self.path(s).name for s in sorted(newer)]


class EventRecorder(Callback):
    """Hears every event the trainer writes (Callbacks.on_event)."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def on_event(self, trainer, record: dict[str, Any]) -> None:
        self.records.append(record)


class StubTrainer:
    """The Trainer attributes the healer and callbacks use; `step_end` and `after_backward` run
    one step's calls the way Trainer.train_step and fit do (the healer's after_step, then the
    callbacks' on_step_end)."""

    step = Trainer.step
    event = Trainer.event
    request_stop = Trainer.request_stop

    def __init__(
        self,
        path: Path,
        callbacks: Sequence[Callback] = (),
        rank: int = 0,
        world_size: int = 1,
        num_samples: int = 10_000,
        healer: Healer | None = None,
        stream: SampleStream | None = None,
        global_batch: int = GLOBAL_BATCH,
    ) -> None:
        """`stream`: the data stream (default: one corpus of `num_samples`), read
        `global_batch` samples a step."""
        self.env = DistEnv(rank=rank, world_size=world_size)
        self.run_dir = RunDir(path, self.env.is_main)
        self.recorder = EventRecorder()
        self.callbacks = Callbacks([*callbacks, self.recorder])
        self.state = Counters()
        self.backend = StubBackend()
        stream = stream if stream is not None else SampleStream(num_samples, seed=0)
        self.loader = StubLoader(stream, global_batch)
        self.run = RunState(self.backend, self.state, stream, global_batch, global_batch)
        self.run.add("callbacks", self.callbacks, missing={})
        self.healer = healer
        self.replicas = NoReplicaGroups()
        if healer is not None:
            self.run.add("resilience", healer, rollback=False)
            healer.attach(self.run, self, StubMonitor(), self.replicas, self.run_dir)
        self.replaying = False
        self.stop_signal: str | None = None
        self.step_in_progress: int | None = None

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        return [e for e in self.recorder.records if kind is None or e["kind"] == kind]

    def after_backward(self, local_loss: float = 2.0) -> StepResult:
        """on_after_backward of the next step, with this rank's loss."""
        step = self.step_in_progress = self.state.step + 1
        result = StepResult(step, 1e-3, local_loss=torch.tensor(local_loss))
        self.callbacks.on_after_backward(self, result)
        self.step_in_progress = None
        return result

    def step_end(
        self,
        anomaly: Anomaly | None = None,
        action: str | None = None,
        skipped: bool = False,
        overflow: bool = False,
        scale_update: ScaleUpdate | None = None,
        preempt: bool = False,
    ) -> StepResult:
        """One step as the loop ends it: its batch taken, the update applied unless `skipped`,
        the counters advanced, then the healer's after_step and on_step_end. `action`: the
        decision, for tests of callbacks without a healer."""
        if self.healer is not None:
            self.healer.before_step()
        self.loader.stream.take(self.loader.global_batch_size)
        if skipped:
            self.state.skipped_steps += 1
        else:
            self.backend.weight += 1
        self.state.step += 1
        self.state.samples_seen += self.loader.global_batch_size
        result = StepResult(
            self.state.step,
            1e-3,
            anomaly=anomaly,
            action=action,
            skipped=skipped,
            overflow=overflow,
            scale_update=scale_update,
            preempt=preempt,
            finite=not (anomaly and anomaly.kind == "nonfinite"),
        )
        if self.healer is not None:
            self.healer.after_step(result)
        self.callbacks.on_step_end(self, result)
        if self.healer is not None:
            self.healer.end_step()
        return result

    def healthy(self, num_steps: int) -> None:
        for _ in range(num_steps):
            self.step_end()


def stub_healer(
    manager: StubManager, monitor: dict | None = None, checkpoint_every: int = 0, **resilience
) -> Healer:
    """A Healer over the stub trainer's parts: no gradient names; the start rebuilt by zeroing
    the stub weight (what 'initial values' are for it)."""
    cfg = Config()
    r = dataclasses.replace(cfg.resilience, **resilience)
    m = dataclasses.replace(cfg.monitor, **(monitor or {}))
    max_steps = cfg.train.max_steps
    healer = Healer(r, m, checkpoint_every, max_steps, [], manager, start_weights=None)
    return healer
