"""Metrics at log steps: metrics.jsonl (rank 0) and a console progress bar with loss, tokens/s, ETA."""

from __future__ import annotations

import sys
from typing import Any

import torch
from tqdm import tqdm

from bigtrain.data.mixture import MixtureStream
from bigtrain.telemetry.memory import peak_memory_bytes
from bigtrain.telemetry.mfu import mfu
from bigtrain.train.hooks import Callback
from bigtrain.train.step import StepResult

CONSOLE_EVENTS = {
    "resume",
    "replay",
    "straggler",
    "hang",
    "suspect_host",
    "checkpoint",
    "anomaly",
    "abort",
    "skip_data",
    "rollback",
    "lr_backoff",
    "preempt",
    "checkpoint_invalid",
    "checkpoint_refused",
    "lr_restore",
    "source_exhausted",
    "profile",
}


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
            record["mfu"] = mfu(
                record["tokens_per_s"],
                setup.flops_per_token,
                setup.peak_flops,
                trainer.env.world_size,
            )
        self.interval_time, self.interval_tokens = 0.0, 0
        trainer.run_dir.metrics(record)
        result.record = record


class ConsoleProgress(Callback):
    """tqdm bar on rank 0 (stderr) when stderr is a terminal; otherwise (batch jobs, CI logs) one
    line per logged step. Events are printed above the bar."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.bar: tqdm | None = None

    def on_start(self, trainer) -> None:
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
        if self.bar is None:
            if self.enabled and record:
                val = f" val_loss {record['val_loss']:.4f}" if "val_loss" in record else ""
                print(
                    f"step {record['step']}/{trainer.cfg.train.max_steps} loss {record['loss']:.4f}{val} "
                    f"lr {record['lr']:.2e} tok/s {record['tokens_per_s']:.0f}",
                    file=sys.stderr,
                    flush=True,
                )
            return
        self.bar.update(1)
        if record:
            postfix = {"loss": f"{record['loss']:.4f}", "tok/s": f"{record['tokens_per_s']:.0f}"}
            if "val_loss" in record:
                postfix["val"] = f"{record['val_loss']:.4f}"
            self.bar.set_postfix(postfix, refresh=False)

    def on_event(self, trainer, record: dict[str, Any]) -> None:
        if trainer.env.is_main and record["kind"] in CONSOLE_EVENTS:
            details = {k: v for k, v in record.items() if k not in ("time", "kind", "step")}
            line = f"[step {record['step']}] {record['kind']}: {details}"
            (self.bar.write if self.bar else print)(line, file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
