"""Assembling a run from its config: data, model, precision, backend, callbacks, where it starts.
`build()` returns it as a frozen Run; bigtrain.runner drives it."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from bigtrain.callbacks.checkpointing import CheckpointCallback
from bigtrain.callbacks.cost_ledger import CostLedger
from bigtrain.callbacks.drills import Drills
from bigtrain.callbacks.evaluate import EvalCallback
from bigtrain.callbacks.fp8_health import Fp8Health
from bigtrain.callbacks.int8_calibration import Int8Calibration, held_layers
from bigtrain.callbacks.metrics import ConsoleProgress, MetricsLogger
from bigtrain.callbacks.mixture_events import SourceEvents
from bigtrain.callbacks.preempt import PreemptionHandler
from bigtrain.callbacks.profiler import ProfilerCallback
from bigtrain.callbacks.samples import SampleCallback
from bigtrain.callbacks.sink_logger import SinkLogger, make_sinks
from bigtrain.callbacks.straggler import StragglerReport
from bigtrain.callbacks.watchdog import HangWatchdog, enable_nccl_flight_recorder
from bigtrain.checkpoint.manager import CheckpointManager, corrupt_newest_checkpoint
from bigtrain.config import (
    Config,
    DataConfig,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
    to_dict,
    to_yaml,
)
from bigtrain.config.model import moe_blocks
from bigtrain.config.resilience import MonitorConfig
from bigtrain.data import (
    BatchLoader,
    TokenCorpus,
    TrainingData,
    eval_batches,
    from_corpus,
    prepare_corpus,
)
from bigtrain.data.prepare.cache import cache_root
from bigtrain.data.read.sources import check_length, open_mixture
from bigtrain.errors import AbortRun, ConfigError, ReplicaMismatch, SharedConfigError
from bigtrain.model.gpt import gradient_roles
from bigtrain.monitor.checksums import Coverage, GradChecksums, unsupported
from bigtrain.monitor.fp8 import Fp8Stats
from bigtrain.monitor.monitor import GradMonitor
from bigtrain.monitor.routers import RouterStats
from bigtrain.parallel.backends.base import Backend
from bigtrain.parallel.env import DistEnv, init_process_group, pick_device
from bigtrain.parallel.layout import Layout
from bigtrain.parallel.model_setup import ModelFacts, make_model
from bigtrain.parallel.parallelize import parallelize
from bigtrain.parallel.replicas.connect import check_lighthouse, group_index
from bigtrain.parallel.replicas.groups import (
    NoReplicaGroups,
    ReplicaGroups,
    make_replica_groups,
)
from bigtrain.parallel.tensor.plans import dropout_seed, uses_gpt_plan
from bigtrain.precision import PrecisionPolicy, dtype_name
from bigtrain.resilience import Healer
from bigtrain.resume import (
    find_resume,
    keep_global_batch,
    run_identity,
    start_state,
    start_weights,
)
from bigtrain.store.rundir import RunDir, check_out_dir
from bigtrain.store.runlock import RunLock, lock_run_dir
from bigtrain.telemetry.mfu import resolve_peak_flops
from bigtrain.train import Trainer
from bigtrain.train.hooks import Callback, Callbacks
from bigtrain.train.setup import RunSetup, StartPoint
from bigtrain.utils.clock import StartupClock, last_event_time
from bigtrain.utils.dist import barrier
from bigtrain.utils.logs import add_rank_file, rank_log_file, remove_handler
from bigtrain.utils.triton import triton_available

logger = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def make_monitor(
    cfg: MonitorConfig,
    backend: Backend,
    layout: Layout,
    device: torch.device,
    model: ModelConfig | None = None,
    fp8: Fp8Stats | None = None,
    parallel: ParallelConfig | None = None,
    replay: bool = True,
) -> GradMonitor:
    """The gradient monitor over the backend's (aligned) gradient names; Triton where it runs;
    with an MoE `model`, its routers' numbers too; with FP8 layers, their statistics."""
    choice = cfg.kernel
    if choice == "triton" and not triton_available(device):
        raise ConfigError(
            f"key 'monitor.kernel' got 'triton', but Triton cannot launch on {device} "
            "(it needs a CUDA device); use auto or torch"
        )
    use_kernel = choice == "triton" or (choice == "auto" and device.type == "cuda")
    use_kernel = use_kernel and triton_available(device)
    names, replicas = backend.monitored()
    if model is not None and model.kind == "hf":  # a transformers MoE family's router probes
        routers = RouterStats.of_family([backend.model], gather=layout.pp > 1)
    else:
        blocks = [f"blocks.{i}" for i in moe_blocks(model)] if model is not None else []
        routers = RouterStats.of([backend.model], blocks, model.moe.experts) if model else None
    riders = [r for r in (routers, fp8) if r is not None]
    checksums = make_checksums(
        cfg, backend, layout, device, names, replicas, model, parallel, replay
    )
    return GradMonitor(
        cfg, names, device, use_kernel, replicas, layout, riders=riders, checksums=checksums
    )


def make_checksums(
    cfg: MonitorConfig,
    backend: Backend,
    layout: Layout,
    device: torch.device,
    names: list[str],
    replicas: list[int],
    model: ModelConfig | None,
    parallel: ParallelConfig | None,
    replay: bool = True,
) -> GradChecksums | Coverage:
    """The gradient checksums (monitor/checksums.py) where the layout lets them check; else
    the reason they are off (logged, and in the start event)."""
    if not cfg.checksum.enabled:
        return Coverage(reason="monitor.checksum.enabled=false")
    if not replay:  # a mismatch is acted on by a replay
        return Coverage(reason="resilience.replay=false: a mismatch would replay the step")
    compiled = parallel is not None and parallel.compile
    reason = unsupported(layout, backend.name, compiled)
    if not reason and model is not None and model.kind == "hf":
        reason = "model.kind=hf: transformers' modules are not checked yet"
    if reason:
        logger.info("gradient checksums off: %s", reason)
        return Coverage(reason=reason)
    checksums = GradChecksums(
        cfg.checksum, backend.model, names, replicas, layout.replicate * layout.shard, device
    )
    checksums.mark_checkpointed(backend.model)
    return checksums


@dataclass(frozen=True)
class Run:
    """A run as setup leaves it: the trainer (which holds what was built, `trainer.setup`), where
    it starts, and what the driver releases at the end."""

    trainer: Trainer
    start: StartPoint
    lock: RunLock | None  # None on ranks other than 0
    log_file: logging.Handler
    costs: CostLedger  # what failures and their insurance cost (callbacks/cost_ledger.py)
    replicas: ReplicaGroups | NoReplicaGroups  # torchft's manager, with replica groups

    def release(self) -> None:
        """The replica group's manager, the run directory's lock and this rank's log file."""
        try:
            self.replicas.close()
        finally:
            if self.lock is not None:
                self.lock.release()
            remove_handler(self.log_file)


def build_trainer(cfg: Config, env: DistEnv) -> Trainer:
    """The trainer alone (tests and benches): the run directory stays locked by this process."""
    return build(cfg, env).trainer


def build(cfg: Config, env: DistEnv) -> Run:
    """Everything a run needs, in the order it needs it; on an error nothing of it stays behind
    (a run directory this call created is removed again)."""
    clock = StartupClock()
    clock.mark("process")  # the interpreter, imports and the config
    # Saved as given: a config with train.global_batch_size runs again at any world size.
    config_yaml = to_yaml(cfg)
    # The one layout of this process; sizes that do not divide: exit 2 before any work.
    groups = (
        cfg.fault_tolerance.groups
    )  # replica groups: each process is in one (parallel/replicas/groups.py)
    layout = Layout.of(cfg.parallel, env.world_size, env.rank, groups, group_index(groups))
    # train.global_batch_size -> grad_accum_steps for the data-parallel ranks (tp shares a batch)
    cfg = dataclasses.replace(cfg, train=layout.batch(cfg.train))
    if cfg.parallel.backend == "local" and layout.pp == 1 and env.world_size != 1:
        raise SharedConfigError(
            f"parallel.backend=local runs one process, but the launcher started {env.world_size}; "
            "use parallel.backend=fsdp or zero"
        )
    out = Path(cfg.train.out_dir)
    check_out_dir(out)
    device = pick_device(cfg.train.device, env)
    if device.type == "cuda":
        enable_nccl_flight_recorder()  # before the process group: dumped if the run hangs
    init_process_group(
        env,
        device,
        cfg.parallel.timeout_s,
        required=cfg.parallel.backend != "local" or layout.pp > 1,
    )
    layout = layout.connect(device.type)  # the DeviceMesh: every rank, once
    if layout.ft > 1:  # a wrong address fails now, not after the data and the model
        check_lighthouse(cfg.fault_tolerance, layout)
    clock.mark("process_group")
    created = not out.exists()
    run_dir = RunDir(out, env.is_main, layout.ft_group if layout.ft > 1 else None)
    lock = lock_run_dir(run_dir, cfg.train.lock_timeout_s, env.is_main)
    clock.previous_end = last_event_time(out / "events.jsonl")  # a restart's gap starts there
    log_file = add_rank_file(run_dir.per_group("logs"), env.rank)
    try:
        return _assemble(cfg, env, layout, run_dir, device, lock, log_file, config_yaml, clock)
    except BaseException:
        remove_handler(log_file)
        if lock is not None:
            lock.release()
            if created:  # a setup error leaves no run directory of its own behind
                for made in ("logs", "tokenizer"):
                    shutil.rmtree(out / made, ignore_errors=True)
                (out / "hf_config.json").unlink(missing_ok=True)
                with contextlib.suppress(OSError):
                    out.rmdir()
        raise


def _check_run_dir(resume: str, run_dir: RunDir, manager: CheckpointManager) -> None:
    if run_dir.aborted_marker.exists():
        raise AbortRun(
            f"{run_dir.aborted_marker} exists: this run gave up earlier "
            f"({run_dir.aborted_marker.read_text().strip()}); remove the marker to try again"
        )
    if run_dir.differ_marker.exists():
        raise ReplicaMismatch(
            f"{run_dir.differ_marker} exists: the replica groups ended with different weights "
            f"({run_dir.differ_marker.read_text().strip()}); see events.jsonl, then remove the "
            "marker to run again"
        )
    if resume == "never" and manager.committed():
        raise ConfigError(
            f"checkpoint.resume=never but {run_dir.checkpoints} already holds checkpoints; "
            "use checkpoint.resume=auto or another train.out_dir"
        )


def make_data(
    data_cfg: DataConfig,
    train: TrainConfig,
    model: ModelConfig,
    env: DistEnv,
    layout: Layout,
    device: torch.device,
) -> tuple[TrainingData, BatchLoader, list]:
    """(the training data, its batch loader, the validation batches) of `data_cfg`, in
    sequences of model.seq_len, batched as `train` says, for this rank's slice (`layout`)."""
    if data_cfg.pin_memory and device.type != "cuda":
        raise ConfigError(
            f"key 'data.pin_memory' is true, but the device is {device}: pinned memory needs CUDA "
            "(leave it null: on for CUDA)"
        )
    dp_rank, dp_size = layout.dp_rank, layout.dp_size  # a tp group reads one slice
    if data_cfg.source == "prepared":
        data = open_mixture(data_cfg, model.seq_len, train.seed, env.is_main)
        needed = train.max_steps * train.micro_batch_size * train.grad_accum_steps * dp_size
        check_length(data.stream, needed, train.max_steps)
    else:
        corpus = _token_corpus(data_cfg, env)
        data = from_corpus(corpus, model.seq_len, data_cfg.val_fraction, train.seed)
    if model.vocab_size is not None and model.vocab_size < data.vocab_size:
        raise ConfigError(
            f"key 'model.vocab_size' ({model.vocab_size}) is smaller than the tokenizer's "
            f"vocabulary ({data.vocab_size})"
        )
    pin = device.type == "cuda" if data_cfg.pin_memory is None else data_cfg.pin_memory
    loader = BatchLoader(
        data.train,
        data.stream,
        train.micro_batch_size,
        train.grad_accum_steps,
        dp_rank,
        dp_size,
        device,
        prefetch=data_cfg.prefetch,
        pin_memory=pin,
    )
    val = eval_batches(
        data.val, train.micro_batch_size, train.eval_batches, dp_rank, dp_size, device
    )
    return data, loader, val


def _token_corpus(data_cfg: DataConfig, env: DistEnv) -> TokenCorpus:
    # Rank 0 tokenizes (or finds the cache) first; the others then read the cache it wrote.
    if env.is_main:
        corpus = prepare_corpus(data_cfg)
    barrier()
    if not env.is_main:
        corpus = prepare_corpus(data_cfg)
    return corpus


def make_callbacks(
    cfg: Config, env: DistEnv, run_dir: RunDir, manager: CheckpointManager, built: BuiltParts
) -> list[Callback]:
    """Every callback of a run, in the order they run (train/hooks.py), each with why it is there."""
    order: list[Callback | None] = [
        # Before anything reads the gradients or the loss: a drill's fault is in the step.
        Drills(cfg.drill, env.rank, built.group),
        # The step's activations folded in before checkpoints and the healer's snapshot hold it.
        Int8Calibration(built.int8_layers, cfg.precision.int8) if built.int8_layers else None,
        # Moves FP8 layers to BF16 after the healer's decision (a rollback keeps the move);
        # writes the fp8 numbers into result.telemetry, which the metrics record holds.
        Fp8Health(built.fp8, cfg.precision.fp8, built.policy)
        if built.fp8 is not None and built.policy is not None
        else None,
        # Writes result.val_loss, which the metrics record and the sinks read.
        EvalCallback(built.val, cfg.train.eval_every),
        # Writes result.samples after evaluation; the sinks read them.
        SampleCallback(cfg.eval, str(built.tokenizer_dir), cfg.model.seq_len, cfg.train.seed)
        if cfg.eval.sample_every > 0
        else None,
        CheckpointCallback(manager, cfg.checkpoint),
        # Writes result.step_time_by_rank, which the metrics record holds.
        StragglerReport(cfg.monitor.straggler_factor),
        # After a rollback has moved the cursor back.
        SourceEvents() if cfg.data.source == "prepared" else None,
        # Writes result.record, which the console and the sinks read.
        MetricsLogger(),
        # After the checkpoint and the metrics; before preemption ends the run.
        built.costs,
        ConsoleProgress(cfg.train.progress and env.is_main),
        # With replica groups, group 0's rank 0 feeds the sinks (one wandb run per job).
        SinkLogger(built.sinks, cfg.log.hold_steps, to_dict(cfg))
        if built.sinks and built.group == 0
        else None,
        # Ends the run (exit 4) once this step's checkpoint and metrics are written.
        PreemptionHandler(),
        # The beat marks the step's end: after the step's checkpoint and evaluation.
        HangWatchdog(
            cfg.resilience,
            cfg.parallel.timeout_s,
            env.rank,
            run_dir.per_group("hang"),
            rank_log_file(run_dir.per_group("logs"), env.rank),
        ),
        # Last: the step's other callbacks are inside the step's trace.
        ProfilerCallback(cfg.profile, env.rank)
        if (cfg.profile.steps or cfg.profile.memory) and env.rank in cfg.profile.ranks
        else None,
    ]
    return [c for c in order if c is not None]


@dataclass(frozen=True)
class BuiltParts:
    """What the callbacks are made from, besides the config."""

    val: list  # the validation batches
    int8_layers: dict
    fp8: Fp8Stats | None  # the FP8 layers and their statistics (the monitor carries them)
    tokenizer_dir: str
    sinks: list  # the metric sinks, not yet started (every rank checks the packages)
    costs: CostLedger
    group: int = 0  # this process's replica group (0 without fault tolerance)
    policy: PrecisionPolicy | None = None  # the precision policy (its FP8 rows change at resume)


def _assemble(
    cfg: Config,
    env: DistEnv,
    layout: Layout,
    run_dir: RunDir,
    device: torch.device,
    lock: RunLock | None,
    log_file: logging.Handler,
    config_yaml: str,
    clock: StartupClock,
) -> Run:
    manager = CheckpointManager(
        run_dir.checkpoints, cfg.checkpoint.keep, layout.rank, layout.world_size
    )
    _check_run_dir(cfg.checkpoint.resume, run_dir, manager)
    corrupted = None
    if cfg.drill.corrupt_checkpoint:  # the drill: before the newest checkpoint is verified
        if env.is_main:
            corrupted = corrupt_newest_checkpoint(run_dir.checkpoints, run_dir.path)
        barrier()
    # What it resumes, first: a checkpoint's global batch is kept at this world size.
    target = find_resume(cfg.checkpoint.resume, manager)
    clock.mark("checkpoint_load")  # its verification (the load itself comes last)
    train, batch_note = keep_global_batch(cfg.train, layout, target, manager)
    cfg = dataclasses.replace(cfg, train=train)
    if cfg.train.num_threads > 0:
        torch.set_num_threads(cfg.train.num_threads)
    seed_everything(cfg.train.seed)
    data, loader, val = make_data(cfg.data, cfg.train, cfg.model, env, layout, device)
    clock.mark("data")
    model, facts = make_model(cfg, layout, data.vocab_size, device, data.eos_id)
    manager.carry = save_run_files(
        run_dir.path, data.tokenizer_dir, model, writes_run_files(run_dir)
    )
    backend = parallelize(model, cfg, layout, facts.policy, device)  # TP, AC, compile, FSDP2/ZeRO
    if layout.tp > 1 and uses_gpt_plan(model):
        torch.manual_seed(dropout_seed(cfg.train.seed, layout.rank))
    fp8 = Fp8Stats(facts.fp8_layers) if facts.fp8_layers else None
    monitor = make_monitor(
        cfg.monitor, backend, layout, device, cfg.model, fp8, cfg.parallel, cfg.resilience.replay
    )
    clock.mark("model")
    setup = _run_setup(cfg, layout, device, facts, data, loader, monitor, config_yaml)
    ledger = CostLedger(clock)
    sinks = make_sinks(cfg.log, cfg.wandb, run_dir.path)  # every rank checks the packages
    parts = BuiltParts(
        val,
        held_layers(backend.model, facts.int8_layers),
        fp8,
        data.tokenizer_dir,
        sinks,
        ledger,
        layout.ft_group,
        facts.policy,
    )
    callbacks = make_callbacks(cfg, env, run_dir, manager, parts)
    initial = start_weights(cfg.model, cfg.train.seed, backend, manager, device)
    healer = Healer(
        cfg.resilience,
        cfg.monitor,
        cfg.checkpoint.every,
        cfg.train.max_steps,
        monitor.names,
        manager,
        initial,
        gradient_roles(monitor.names, cfg.model),
    )
    # Last: torchft's manager starts threads and servers, which close() must stop on an error.
    replicas = make_replica_groups(cfg.fault_tolerance, layout, device)
    try:
        monitor.across_groups = replicas.across_groups
        trainer = Trainer(
            cfg,
            env,
            backend,
            loader,
            run_dir,
            Callbacks(callbacks),
            device,
            setup,
            monitor,
            healer,
            replicas,
        )
        clock.mark("setup_other")
        start = start_state(cfg, trainer.run, setup, manager, target, corrupted, batch_note)
    except BaseException:
        replicas.close()
        raise
    clock.mark("checkpoint_load")  # or model.init_from's weights; with the data position
    return Run(trainer, start, lock, log_file, ledger, replicas)


def _run_setup(
    cfg: Config,
    layout: Layout,
    device: torch.device,
    facts: ModelFacts,
    data: TrainingData,
    loader: BatchLoader,
    monitor: GradMonitor,
    config_yaml: str,
) -> RunSetup:
    """What was built, as the trainer and the callbacks read it."""
    peak_flops, peak_source = resolve_peak_flops(
        device,
        dtype_name(facts.policy.compute_dtype),
        facts.policy.allow_tf32,
        cfg.train.peak_flops,
        cache_root(cfg.data),
    )
    return RunSetup(
        layout=layout,
        policy=facts.policy,
        num_params=facts.num_params,
        shapes=facts.shapes,
        flops_per_token=facts.flops_per_token,
        peak_flops=peak_flops,
        peak_flops_source=peak_source,
        identity=run_identity(cfg.model, data.key, loader.global_batch_size),
        config_yaml=config_yaml,
        corpus=data.summary,
        monitor_kernel="triton" if monitor.use_kernel else "torch",
        build_site=facts.build_site,
        skipped_rows=data.skipped_rows,
        fp8_layers=facts.fp8_layers,
    )


def writes_run_files(run_dir: RunDir) -> bool:
    """Rank 0 writes the tokenizer and model config; with replica groups, group 0's rank 0 and
    only while they are missing (a restarted group never rewrites what a checkpoint being
    written by another group copies)."""
    if run_dir.group is None:
        return run_dir.is_main
    return run_dir.is_main and run_dir.group == 0 and not (run_dir.path / "tokenizer").exists()


def save_run_files(out: Path, tokenizer_dir: str, model: nn.Module, is_main: bool) -> list[Path]:
    """The run's tokenizer and, for a transformers model, its config, beside the run's config
    (rank 0 writes them); checkpoints carry a copy of each."""
    tokenizer, hf_config = out / "tokenizer", out / "hf_config.json"
    hf = getattr(model, "hf", None)
    if is_main:
        shutil.rmtree(tokenizer, ignore_errors=True)  # no files of an earlier tokenizer
        # The prepared corpus's tokenizer directory (checked against its manifest's sha256),
        # copied as it is: loading it through transformers to save it again cost a second of
        # imports in every process that starts a run.
        shutil.copytree(tokenizer_dir, tokenizer)
        if hf is not None:
            config = {k: v for k, v in hf.config.to_dict().items() if k != "_name_or_path"}
            hf_config.write_text(json.dumps(config, indent=1))
    return [tokenizer, hf_config] if hf is not None else [tokenizer]
