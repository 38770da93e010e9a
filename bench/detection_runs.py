"""The runs of bench/detection.py: its corpora, the healthy matrix, and the recording of what the
monitor's detection sees at every step of a healthy run, per emulated rank.

One process stands in for two data-parallel ranks: with micro_batch_size 8 and grad_accum_steps 2,
micro-batch m holds the samples rank m of a 2-rank run (micro_batch_size 8, no accumulation)
computes, and each gradient's two row halves (`chunk(2, dim=0)`) are the shards FSDP2 gives the
two ranks. A fault on rank r changes that rank's loss and halves only, as the drills do.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.multiprocessing as mp

from bigtrain.build import build
from bigtrain.config import load_config
from bigtrain.config.schema import MonitorConfig
from bigtrain.monitor.checksums import FLOOR
from bigtrain.parallel.env import DistEnv, free_port, read_env, shutdown
from bigtrain.resilience.detect import ROUTER_VALUES

ROOT = Path(__file__).resolve().parents[1]
RANKS = 2  # emulated data-parallel ranks: micro-batch m and row half m belong to rank m

TINY = str(ROOT / "configs/tiny.yaml")
MICRO = ["model.n_layers=2", "model.n_heads=2", "model.d_model=64", "model.seq_len=64"]
MOE = ["model.moe.experts=4", "model.moe.top_k=2"]
"""The MoE sweep's blocks: 4 experts, 2 per token, dropless, the default coefficients."""
MICRO_VOCAB = 512
TINY_VOCAB = 2048
STYLES = {
    "gpt2": [],
    "llama": ["model.position=rope", "model.norm=rmsnorm", "model.mlp=swiglu", "model.bias=false"],
}
PRECISIONS = {"fp32": "fp32", "bf16": "bf16-mixed"}
CORPORA = ("shakespeare", "stdlib")
LR_MULTS = (1, 2)
TINY_LR = 3e-3
QUIET = [
    "train.eval_every=0",
    "checkpoint.every=-1",
    "wandb.mode=disabled",
    "train.progress=false",
    "resilience.snapshot_every=0",
    "train.log_every=50",
    "train.peak_flops=1e12",  # skips the matmul a CPU run measures at start for MFU
]


def stdlib_corpus(vocab_size: int) -> Path:
    """The second corpus: the standard library's top-level modules (about 170 files, 4.7 MB on
    Python 3.11), one jsonl document per file, prepared once per Python version and vocabulary."""
    cache = Path(os.environ.get("BIGTRAIN_CACHE") or Path.home() / ".cache" / "bigtrain")
    tag = f"{sys.version_info.major}.{sys.version_info.minor}"
    out = cache / f"detection-stdlib-{tag}-v{vocab_size}"
    if (out / "manifest.json").exists():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    jsonl = cache / f"detection-stdlib-{tag}.jsonl"
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    with jsonl.open("w") as f:
        for path in files:
            f.write(json.dumps({"text": path.read_text(errors="replace")}) + "\n")
    from bigtrain.data.prepare.run import prepare  # `bigtrain prepare`'s work, in this process

    overrides = ["data.source=files", f"data.paths=[{jsonl}]", f"data.vocab_size={vocab_size}"]
    prepare(load_config([], overrides).data, out)
    return out


@dataclass(frozen=True)
class RunSpec:
    """One healthy run of the matrix."""

    seed: int
    precision: str  # a key of PRECISIONS
    style: str  # a key of STYLES
    corpus: str  # a member of CORPORA
    lr_mult: int
    micro: bool  # the micro model (--quick) rather than configs/tiny.yaml
    steps: int = 300
    moe: bool = False  # every block's MLP a mixture of experts (MOE; bench/detection.py --moe)
    fp8: bool = False  # the BF16 runs with FP8 linears (bench/detection.py --fp8)

    @property
    def name(self) -> str:
        size = ("micro" if self.micro else "tiny") + ("-moe" if self.moe else "")
        fp8 = getattr(self, "fp8", False)  # a trace saved before --fp8 existed
        precision = "fp8" if fp8 and self.precision == "bf16" else self.precision
        name = f"{size}-{self.style}-{precision}-{self.corpus}-lr{self.lr_mult}x-s{self.seed}"
        return name + (f"-{self.steps}steps" if self.steps != 300 else "")

    def overrides(self, out_dir: str, world_size: int = 1) -> list[str]:
        """The run's config overrides on configs/tiny.yaml; `world_size` 2: the same global batch
        as two FSDP2 ranks of one micro-batch each."""
        vocab = MICRO_VOCAB if self.micro else TINY_VOCAB
        args = [*(MICRO if self.micro else []), f"data.vocab_size={vocab}"]
        if self.corpus == "stdlib":
            args += ["data.source=prepared", f"data.mixture=[{stdlib_corpus(vocab)}]"]
        args += STYLES[self.style] + [f"precision.preset={PRECISIONS[self.precision]}"]
        args += [f"train.seed={self.seed}", f"optim.lr={TINY_LR * self.lr_mult}"]
        args += [f"train.max_steps={self.steps}", "train.micro_batch_size=8"]
        args += [f"train.grad_accum_steps={RANKS // world_size}", f"train.out_dir={out_dir}"]
        if world_size > 1:
            args += ["parallel.backend=fsdp"]
        if self.fp8 and self.precision == "bf16":  # FP8 computes beside BF16
            args += ["precision.fp8.enabled=true", "precision.fp8.check_every=25"]
        return args + (MOE if self.moe else []) + QUIET


def matrix(
    seeds: list[int], micro: bool, steps: int, moe: bool = False, fp8: bool = False
) -> list[RunSpec]:
    """Seeds x precisions x styles x corpora x LRs, seed by seed. Within a seed the half
    fraction whose levels (as 0/1) add up to an even number comes first: any 6 leading runs
    cover both levels of every factor (bench --runs 6 makes the test fixtures)."""
    levels = (list(PRECISIONS), list(STYLES), list(CORPORA), list(LR_MULTS))
    combos = sorted(itertools.product(range(2), repeat=4), key=lambda c: (sum(c) % 2, c))
    return [
        RunSpec(
            seed,
            *(level[i] for level, i in zip(levels, combo, strict=True)),
            micro,
            steps,
            moe,
            fp8,
        )
        for seed in seeds
        for combo in combos
    ]


@dataclass
class Trace:
    """What the monitor saw at each step of a healthy run (index 0 = step 1)."""

    spec: RunSpec
    names: list[str]  # gradient tensors, in the monitor's order
    loss: list[float] = field(default_factory=list)  # the Health's host values
    grad_norm: list[float] = field(default_factory=list)
    micro_loss: list[list[float]] = field(default_factory=list)  # [step][rank]
    halves: list[np.ndarray] = field(default_factory=list)  # [step] -> [tensor, rank] sum of sq.
    sizes: np.ndarray | None = None  # [tensor, rank] values in each half (0: the rank holds none)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)  # the run's detection settings
    routers: list[dict[str, float]] = field(default_factory=list)  # [step] MoE router telemetry
    anomalies: list[dict] = field(default_factory=list)  # the run's anomaly events
    suspicions: list[dict] = field(default_factory=list)  # its suspicion events (replays)
    fp8_fallbacks: list[dict] = field(default_factory=list)  # its fp8_fallback events
    checks: list[np.ndarray] = field(default_factory=list)
    """[step] -> [tensor, rank]: the gradient checksums' residual of each row half (NaN:
    unchecked tensor or step; monitor/checksums.py)."""
    checks_whole: list[np.ndarray] = field(default_factory=list)
    """[step] -> [tensor]: the residual of the whole tensor, as the run's monitor read it."""
    seconds: float = 0.0

    @property
    def name(self) -> str:
        return self.spec.name


ROUTER_KEYS = tuple(ROUTER_VALUES.values())
"""The router telemetry the rules read (resilience/detect.py): kept per step of a trace."""


class Recorder:
    """Wraps a trainer's backend.forward_backward and monitor.check to fill a Trace. A replayed
    or rolled-back step overwrites its earlier record: the trace holds what was applied."""

    def __init__(self, trainer, trace: Trace) -> None:
        self.trainer, self.trace = trainer, trace
        self.micro: list[torch.Tensor] = []
        self.by_step: dict[int, tuple] = {}
        forward_backward, check = trainer.backend.forward_backward, trainer.monitor.check

        def recorded_forward_backward(inputs, targets, micro_step, num_micro_steps):
            loss = forward_backward(inputs, targets, micro_step, num_micro_steps)
            self.micro.append(loss)
            return loss

        def recorded_check(named_grads, local_loss, grad_factor, full, **kwargs):
            health = check(named_grads, local_loss, grad_factor, full, **kwargs)
            self._record(named_grads, health)
            return health

        trainer.backend.forward_backward = recorded_forward_backward
        trainer.monitor.check = recorded_check

    def _record(self, named_grads, health) -> None:
        halves = []
        for _, g in named_grads:
            parts = list(g.detach().float().chunk(RANKS, dim=0))  # FSDP2's dim-0 shards
            halves += parts + [g.new_empty(0, dtype=torch.float32)] * (RANKS - len(parts))
        if self.trace.sizes is None:
            self.trace.sizes = np.asarray([h.numel() for h in halves]).reshape(-1, RANKS)
        norms = torch.stack(torch._foreach_norm(halves, 2))
        micro = torch.stack([m.float() for m in self.micro[-RANKS:]])
        host = torch.cat([micro, norms.square()]).tolist()  # host sync: the bench's own record
        self.micro = []
        step = self.trainer.step_in_progress
        sum_sq = np.asarray(host[RANKS:], dtype=np.float64).reshape(-1, RANKS)
        routers = {k: v for k, v in health.telemetry.items() if k in ROUTER_KEYS}
        self.by_step[step] = (
            health.host_loss,
            health.host_grad_norm,
            host[:RANKS],
            sum_sq,
            routers,
            *self._checks(named_grads, health),
        )

    def _checks(self, named_grads, health) -> tuple[np.ndarray, np.ndarray]:
        """The checksums' residuals of the step per row half (the emulated ranks' shards) and
        of each whole tensor; NaN where unchecked."""
        n = len(self.trace.names)
        halves, whole = np.full((n, RANKS), np.nan), np.full(n, np.nan)
        checksums = self.trainer.monitor.checksums
        if health.checksums is None or checksums is None:
            return halves, whole
        floor = FLOOR * health.host_grad_norm
        for index, (name, grad) in enumerate(named_grads):
            entry = checksums.entries.get(name)
            if entry is None:
                continue
            whole[index] = health.checksums[index]
            observed = grad.detach().float().reshape(entry.rows, entry.cols)
            observed = observed @ checksums.probes[entry.cols]
            expected = checksums.rows_of(entry, checksums.expected)
            for rank, (o, e) in enumerate(
                zip(observed.chunk(RANKS), expected.chunk(RANKS), strict=True)
            ):
                scale = max(float(o.norm()), float(e.norm()), floor)  # the bench's own sync
                halves[index, rank] = float((o - e).norm()) / scale if scale else 0.0
        return halves, whole

    def finish(self) -> Trace:
        for step in sorted(self.by_step):
            loss, norm, micro, halves, routers, checks, whole = self.by_step[step]
            self.trace.checks.append(checks)
            self.trace.checks_whole.append(whole)
            self.trace.routers.append(routers)
            self.trace.loss.append(loss)
            self.trace.grad_norm.append(norm)
            self.trace.micro_loss.append(micro)
            self.trace.halves.append(halves)
        return self.trace


def healthy_run(spec: RunSpec, out_dir: str) -> Trace:
    """Train one run of the matrix in this process, detection on as configured; its trace and
    its anomaly events (false alarms: no fault was injected)."""
    started = time.perf_counter()
    cfg = load_config([TINY], spec.overrides(out_dir))
    built = build(cfg, DistEnv())  # released at the end: many runs share this process
    trainer = built.trainer
    try:
        names = list(trainer.monitor.names)
        recorder = Recorder(trainer, Trace(spec, names, monitor=cfg.monitor))
        trainer.fit(resumed=False)
    finally:
        trainer.callbacks.close()
        built.release()  # its log file and lock (each run's log held only its own records)
    trace = recorder.finish()
    events = read_events(out_dir)
    trace.anomalies = [e for e in events if e["kind"] == "anomaly"]
    trace.suspicions = [e for e in events if e["kind"] == "suspicion"]
    trace.fp8_fallbacks = [e for e in events if e["kind"] == "fp8_fallback"]
    trace.seconds = time.perf_counter() - started
    return trace


def caught(event: dict) -> bool:
    """An event of a caught fault: an anomaly, or a replay that came out clean (a transient
    fault: the replayed step goes on, no anomaly is left to report)."""
    transient = event["kind"] in ("replay", "suspicion") and event["verdict"] == "transient"
    return event["kind"] == "anomaly" or transient


def read_events(out_dir: str) -> list[dict]:
    path = Path(out_dir) / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@dataclass(frozen=True)
class Trial:
    """One real 2-rank run with one injected fault (kind as in detection_sim.KINDS)."""

    spec: RunSpec
    kind: str
    step: int
    rank: int

    def overrides(self, out_dir: str) -> list[str]:
        name, _, factor = self.kind.partition("_x")
        drill = {"grad_spike_first": "grad_spike"}.get(name, name)  # the drill's default tensor
        args = [f"drill.{drill}_step={self.step}", f"drill.rank={self.rank}"]
        args += ["drill.router_bias=0"] if name == "router_bias" else []  # expert 0 favoured
        args += [f"drill.spike_factor={factor}"] if factor else []
        # The healthy run's schedule (max_steps), stopped once the fault had 3 steps to show;
        # `skip` instead of a rollback: the same verdict, and no steps trained again.
        args += [f"train.stop_at_step={self.step + 3}"]
        args += ["monitor.on_spike=skip", "monitor.nonfinite=skip"]
        return self.spec.overrides(out_dir, world_size=RANKS) + args


def validate(trials: list[Trial], out_root: str) -> list[list[int]]:
    """The trials as real FSDP2 runs on RANKS spawned gloo processes, one after the other in one
    process group (started once); per trial the steps of its anomaly events."""
    context = mp.start_processes(
        _rank_main,
        args=(str(free_port()), trials, out_root),
        nprocs=RANKS,
        start_method="spawn",
        join=False,
    )
    while not context.join():
        pass
    return json.loads((Path(out_root) / "results.json").read_text())


def _rank_main(rank: int, port: str, trials: list[Trial], out_root: str) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(RANKS), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1"
    )
    os.environ["MASTER_PORT"] = port
    torch.set_num_threads(1)  # RANKS processes on as many cores
    found = []
    for i, trial in enumerate(trials):
        out_dir = str(Path(out_root) / f"trial-{i}")
        built = build(load_config([TINY], trial.overrides(out_dir)), read_env())
        trainer = built.trainer
        try:
            trainer.fit(resumed=False)
        finally:
            trainer.callbacks.close()
            built.release()
        found.append([e["step"] for e in read_events(out_dir) if caught(e)])
    shutdown(clean=True)
    if rank == 0:
        (Path(out_root) / "results.json").write_text(json.dumps(found))


def checksum_margin(traces: list[Trace], monitor) -> dict:
    """The gradient checksums on the healthy runs: steps checked, and the largest residual of
    any tensor or row half (against monitor.checksum.tolerance: each above it a false alarm)."""
    worst, where, checked = 0.0, None, 0
    for trace in traces:
        for step, (halves, whole) in enumerate(zip(trace.checks, trace.checks_whole, strict=True)):
            if not np.isfinite(whole).any():
                continue
            checked += 1
            values = np.concatenate([halves.ravel(), whole])
            top = float(np.nanmax(values))
            if top > worst:
                per_tensor = np.where(np.isfinite(halves), halves, -np.inf).max(axis=1)
                tensor = int(np.argmax(np.maximum(per_tensor, np.nan_to_num(whole, nan=-np.inf))))
                worst, where = top, [trace.name, step + 1, trace.names[tensor]]
    return {
        "tolerance": monitor.checksum.tolerance,
        "until_step": monitor.checksum.until_step,
        "checked_steps": checked,
        "largest_healthy_residual": worst,
        "where": where,
    }
