"""Running a run that bigtrain.build assembled: what setup found as events, the loop, final.json.

final = run(cfg, env)     # build(), events, trainer.fit(), final.json; final.json's data
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from bigtrain.build import Run, build
from bigtrain.config import Config
from bigtrain.errors import AbortRun, GroupLeft, HostExcluded
from bigtrain.parallel.env import DistEnv, shutdown
from bigtrain.telemetry.memory import out_of_memory

logger = logging.getLogger(__name__)


def run(
    cfg: Config, env: DistEnv, memory_plan: Callable[[], dict[str, Any]] | None = None
) -> dict[str, Any]:
    """A whole run: setup, start/resume events, the loop, final.json. Returns final.json's data.
    `memory_plan`: `bigtrain plan`'s prediction for an out-of-memory error's event (the CLI's)."""
    started = time.time()
    built = build(cfg, env)
    trainer = built.trainer
    clean = False  # every rank reached the end without an error (shutdown may then barrier)
    try:
        trainer.run_dir.write_text("config.yaml", trainer.setup.config_yaml)
        setup_events(built, env)
        built.costs.clock.mark("setup_other")
        if trainer.state.step >= cfg.train.max_steps:  # resumed from the last step's checkpoint
            final = _already_finished(built, started)
            clean = True
            return final
        try:
            state = trainer.fit(resumed=built.start.resume is not None)
        except (AbortRun, HostExcluded) as e:  # every rank gave up at the same step
            trainer.callbacks.on_stop(trainer, str(e))
            raise
        except GroupLeft as e:  # this replica group, too slow, left; the others go on
            trainer.callbacks.on_stop(trainer, str(e))
            clean = True
            return {"step": trainer.state.step, "left": str(e)}
        except torch.OutOfMemoryError as e:  # this rank alone: an `oom` event, exit 8
            raise out_of_memory(
                trainer, trainer.device, trainer.run_dir.path, trainer.env.rank, e, memory_plan
            ) from e
        if state.step < cfg.train.max_steps:
            trainer.event(
                "stop",
                reason=f"train.stop_at_step={cfg.train.stop_at_step}",
                max_steps=trainer.cfg.train.max_steps,
            )
            clean = True
            return {"step": state.step, "stopped": True}
        final = trainer.final_record(started)
        final["costs"] = built.costs.summary(trainer)  # measured: callbacks/cost_ledger.py
        trainer.event("finish", **{k: v for k, v in final.items() if k != "step"})
        trainer.run_dir.write_json("final.json", final)
        clean = True
        return final
    finally:
        try:
            trainer.callbacks.close()  # each callback's, the first error raised after
        finally:
            try:
                built.release()  # the lock and log file, whatever a callback's close raised
            finally:
                shutdown(clean)


def setup_events(built: Run, env: DistEnv) -> None:
    """What setup found, printed (rank 0) and as events: start (with the corpus), lock takeover,
    skipped rows, init_from, corrupted or invalid checkpoints, resume."""
    trainer, setup, start = built.trainer, built.trainer.setup, built.start
    logger.info(
        "bigtrain: %.2fM parameters, backend %s, world size %d, device %s\nprecision policy:\n%s",
        setup.num_params / 1e6,
        trainer.backend.name,
        env.world_size,
        trainer.device,
        setup.policy.table(),
    )
    logger.info("data: training on %s", setup.corpus.describe())
    trainer.event(
        "start",
        backend=trainer.backend.name,
        world_size=env.world_size,
        device=str(trainer.device),
        num_params=setup.num_params,
        max_steps=trainer.cfg.train.max_steps,
        precision=setup.policy.to_dict(),
        global_batch_size=trainer.loader.global_batch_size,
        monitor_kernel=setup.monitor_kernel,
        flops_per_token=setup.flops_per_token,
        peak_flops=setup.peak_flops,
        peak_flops_source=setup.peak_flops_source,
        corpus=setup.corpus.to_event(),
        **trainer.monitor.checksum_record(),
    )
    if built.lock is not None and built.lock.taken_over is not None:
        taken = built.lock.taken_over
        trainer.event("lock_takeover", previous=taken.owner, reason=taken.reason)
    if setup.skipped_rows:
        skipped = setup.skipped_rows
        trainer.event("data_skipped_rows", files=skipped, rows=sum(skipped.values()))
    if start.init_from:
        trainer.event("init_from", **start.init_from)
    if start.fault_corrupted:
        trainer.event("fault", type="corrupt_checkpoint", file=start.fault_corrupted)
    for bad in start.invalid_checkpoints:
        trainer.event("checkpoint_invalid", **bad)
    if start.resume:  # the console's line says what changed (telemetry/console.py)
        trainer.event("resume", **start.resume)


def _already_finished(built: Run, started: float) -> dict[str, Any]:
    """A run started again after its last step: nothing to train. final.json stays as the run
    wrote it; one lost after the last checkpoint is written from the checkpoint's state (every
    rank takes this path: the state they resumed is the same)."""
    trainer = built.trainer
    # A replica group that restarts after the others reached the end (from the last step's
    # checkpoint) still takes part in their last quorums, where the groups compare weights.
    trainer.replicas.finish()
    final = trainer.final_record(started)
    if trainer.replicas.groups > 1:  # every group's end is an event (the others wait for it)
        trainer.event("finish", **{k: v for k, v in final.items() if k != "step"})
    path = trainer.run_dir.path / "final.json"
    logger.info(
        "bigtrain: already finished at step %d (train.max_steps=%d): nothing to train; %s",
        trainer.state.step,
        trainer.cfg.train.max_steps,
        f"{path} kept" if path.is_file() else f"{path} written again",
    )
    if trainer.env.is_main:
        if path.is_file():
            return json.loads(path.read_text())
        trainer.run_dir.write_json("final.json", final)
    return final
