"""Metrics at log steps: metrics.jsonl (rank 0), and rank 0's console (telemetry/console.py)."""

from __future__ import annotations

import sys
import time
from typing import Any

import torch
from tqdm import tqdm

from bigtrain.data.read.mixture import MixtureStream
from bigtrain.telemetry.console import eta, event_line, step_line
from bigtrain.telemetry.memory import peak_memory_bytes
from bigtrain.telemetry.mfu import mfu
from bigtrain.train.hooks import Callback
from bigtrain.train.step import StepResult


def _scalar(value: Any) -> Any:
    return value.item() if isinstance(value, torch.Tensor) else value


class MetricsLogger(Callback):
    """Turns the step's device tensors into one JSON record every `train.log_every` steps, at the
    last step and at any anomalous or non-finite step. Records go to `result.record` for the
    console and wandb, which run after this; the record of the evaluation before a fresh run's first
    step (EvalCallback's `trainer.start_record`) is written in `on_start`."""

    def __init__(self) -> None:
        self.interval_time = 0.0
        self.interval_tokens = 0

    def on_start(self, trainer) -> None:
        if trainer.start_record is not None:
            trainer.run_dir.metrics(trainer.start_record)

    def on_step_end(self, trainer, result: StepResult) -> None:
        self.interval_time += result.step_time
        self.interval_tokens += trainer.tokens_per_step
        step = result.step
        if not (
            step % trainer.cfg.train.log_every == 0
            or trainer.is_last_step()
            or not result.finite
            or result.anomaly is not None
            or result.val_loss is not None
            or result.step_time_by_rank is not None
        ):
            return
        # Expensive device-to-host synchronization, at log steps only.
        record = {k: _scalar(v) for k, v in result.logged().items()}
        record["tokens_per_s"] = self.interval_tokens / max(self.interval_time, 1e-9)
        record["samples_seen"] = trainer.state.samples_seen
        record["tokens"] = trainer.state.tokens_seen
        record["skipped_steps"] = trainer.state.skipped_steps
        record["peak_memory_bytes"] = peak_memory_bytes(trainer.device)  # a host query, no sync
        stream = trainer.loader.stream
        if isinstance(stream, MixtureStream):  # tokens trained per source: skip windows left out
            seq_len = trainer.cfg.model.seq_len
            by_source = stream.samples_by_source().items()
            record["tokens_by_source"] = {name: n * seq_len for name, n in by_source}
        setup = trainer.setup
        if setup.flops_per_token and setup.peak_flops:
            # tokens_per_s counts the global batch, every replica group's slice of it: the
            # devices are every group's, not this job's alone (3 groups read 3x too high).
            layout = setup.layout
            num_devices = layout.world_size * layout.ft
            record["mfu"] = mfu(
                record["tokens_per_s"], setup.flops_per_token, setup.peak_flops, num_devices
            )
        self.interval_time, self.interval_tokens = 0.0, 0
        trainer.run_dir.metrics(record)
        result.record = record


class ConsoleProgress(Callback):
    """Rank 0's console (telemetry/console.py): a tqdm bar (stderr) with loss, tokens/s and MFU
    when stderr is a terminal, else one line per logged step with elapsed time and ETA (batch
    jobs, CI logs); events that matter as one formatted line each, above the bar."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.bar: tqdm | None = None
        self.started = time.monotonic()
        # Steps this process ran: the ETA's rate (a resumed or rejoined process starts late).
        self.steps_run = 0
        self.held: list[str] | None = None  # events of a step, printed after its step line

    def on_start(self, trainer) -> None:
        self.started, self.steps_run = time.monotonic(), 0
        self.held = []
        if self.enabled:
            bar = tqdm(
                total=trainer.cfg.train.max_steps,
                initial=trainer.step,
                desc="train",
                unit="step",
                dynamic_ncols=True,
                file=sys.stderr,
                disable=None,
            )
            self.bar = None if bar.disable else bar

    def on_step_end(self, trainer, result: StepResult) -> None:
        record = result.record
        self.steps_run += 1
        if self.bar is None:
            if self.enabled and record:
                elapsed = time.monotonic() - self.started
                left = trainer.end_step - trainer.step
                left_s = eta(elapsed, self.steps_run, left)
                line = step_line(record, trainer.cfg.train.max_steps, elapsed, left_s)
                print(line, file=sys.stderr, flush=True)
            self._flush()
            return
        if self.bar.n != trainer.step - 1:  # a peer's state or a rollback moved the step: no rate
            self.bar.n = self.bar.last_print_n = trainer.step - 1
        self.bar.update(1)
        if record:
            postfix = {"loss": f"{record['loss']:.4f}", "tok/s": f"{record['tokens_per_s']:.0f}"}
            if "val_loss" in record:
                postfix["val"] = f"{record['val_loss']:.4f}"
            if "mfu" in record:
                postfix["mfu"] = f"{record['mfu']:.1%}"
            self.bar.set_postfix(postfix, refresh=False)
        self._flush()

    def on_event(self, trainer, record: dict[str, Any]) -> None:
        line = event_line(record) if trainer.env.is_main else None
        if line is None:
            return
        if self.held is not None:  # during the loop: after the step's own line
            self.held.append(line)
        else:
            self._print(line)

    def _print(self, line: str) -> None:
        (self.bar.write if self.bar else print)(line, file=sys.stderr)

    def _flush(self) -> None:
        if not self.held:
            return
        held, self.held = self.held, []
        for line in held:
            self._print(line)

    def on_finish(self, trainer) -> None:
        self._flush()
        self.held = None  # events after the loop (final.json's) print at once

    def on_stop(self, trainer, reason: str) -> None:
        self.on_finish(trainer)

    def close(self) -> None:
        self._flush()
        self.held = None
        if self.bar is not None:
            self.bar.close()
            self.bar = None
