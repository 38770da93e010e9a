"""`bigtrain plan CONFIG --goodput --gpus N [--from RUN_DIR] [--set key=value ...] [--json]`.

The inputs of the simulation (goodput_inputs.py) come from, in order: defaults (the Llama 3
report's failure rates, public cost figures), the config (the checkpoint bytes per GPU and the
step time of `bigtrain plan`'s model, stages.checkpoint_bytes_per_gpu and step_time.step_time:
the numbers its memory table, per-stage table, step line and `--propose` print; the snapshot and
checkpoint cadence), costs measured in a run directory (telemetry/costs.py), and the user's
`--set`. A measured fixed cost (the restart, a small checkpoint's write and stall) is taken only
from a run at least as large as the plan: a 2-rank restart says nothing of a 16,384-GPU one;
bandwidths, steps and timeouts carry over.

The run is planned as a run of the config at --gpus would be (the accumulation from
train.global_batch_size); where that batch does not divide over the GPUs' data-parallel ranks,
the config's per-rank batch is held (a note says so).

With fault-tolerant replica groups (`fault_tolerance.groups` or `--set replica_groups=N`, > 1) a
third mode, `ft`, is simulated beside healing and plain checkpoint/restart: healing, and a
hardware failure restarts only its group (simulation.py says what each failure costs then).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bigtrain.config.schema import Config
from bigtrain.errors import ConfigError
from bigtrain.parallel.layout import Layout
from bigtrain.plan.footprint import PlannedRun, planned
from bigtrain.plan.goodput_inputs import KEYS, GoodputInputs, Sourced, doc
from bigtrain.plan.simulation import (
    CAUSES,
    best_interval,
    daly_interval,
    simulate,
    young_interval,
)
from bigtrain.plan.stages import checkpoint_bytes_per_gpu, most_states
from bigtrain.plan.step_time import step_time
from bigtrain.precision.policy import Hardware
from bigtrain.telemetry.costs import measured_costs
from bigtrain.utils.sizes import count_text

SMALL_STEP_S = 0.01  # a step shorter than this: a model far too small for the planned GPUs
# Measured fixed costs: only from a run at least as large (a commit's barrier and gathers, a
# restart, grow with the ranks); a group's restart from a run at least as large as one group
FIXED = ("restart_s", "write_fixed_s", "stall_fixed_s", "ft_restart_s")
# Each cost halved (a bandwidth doubled), to say which one to cut first.
CUTS = {
    "restart_s": 0.5,
    "save_gbps_per_node": 2.0,
    "load_gbps_per_node": 2.0,
    "stall_gbps": 2.0,
    "snapshot_gbps": 2.0,
    "hang_timeout_s": 0.5,
}


def config_inputs(run: PlannedRun, gpus: int) -> Sourced:
    """Defaults, then what the planned run's config says: checkpoint bytes per GPU, step time,
    cadence."""
    cfg = run.cfg
    n, load = run.num_params, most_states(run)
    where = "the largest pipeline rank's " if run.layout.pp > 1 else ""
    src = Sourced(gpus)
    full = run.states().bytes_per_param
    saved = full["master weights"] + full["optimizer states"]
    ckpt = checkpoint_bytes_per_gpu(run)
    src.set(
        "ckpt_gb_per_gpu",
        ckpt / 1e9,
        f"plan: {where}{count_text(load.params)} params x {saved:g} B (master + optimizer "
        f"states) / {saved * load.params / ckpt:.4g}",
    )
    step = step_time(run)
    step_s = step.total
    t = cfg.train
    src.set(
        "step_s",
        step_s,
        f"plan: {t.micro_batch_size} x {t.grad_accum_steps} sequences per data-parallel rank: "
        f"{step.parts_text()}",
    )
    if run.held_batch:
        src.notes.append(
            f"train.global_batch_size ({t.global_batch_size}) does not divide over the "
            f"{run.layout.dp_size} data-parallel ranks of {gpus} GPUs: the plan holds the "
            f"config's micro_batch_size x grad_accum_steps ({t.micro_batch_size} x "
            f"{t.grad_accum_steps}) per rank"
        )
    if step_s < SMALL_STEP_S:
        src.notes.append(
            f"the config's model ({count_text(n)} parameters) takes {step_s:.2g} s a step at "
            f"{gpus} GPUs: the plan is of that model; for a recipe's, name its config (bigtrain "
            "plan configs/llama-70b.yaml --goodput --gpus N --from RUN_DIR)"
        )
    hang = cfg.resilience.hang_timeout_s
    hang_how = "resilience.hang_timeout_s" if hang else "max(300 s, 10 x step): the watchdog"
    src.set("hang_timeout_s", hang or max(300.0, 10 * step_s), f"config: {hang_how}")
    ft = cfg.fault_tolerance
    for key, value, name in (
        ("replica_groups", ft.groups, "fault_tolerance.groups"),
        ("ft_stall_s", ft.heartbeat_timeout_s, "fault_tolerance.heartbeat_timeout_s"),
        ("ckpt_every_steps", cfg.checkpoint.every, "checkpoint.every"),
        ("snapshot_every", cfg.resilience.snapshot_every, "resilience.snapshot_every"),
        ("confirm_steps", cfg.resilience.confirm_steps, "resilience.confirm_steps"),
        ("async_save", cfg.checkpoint.async_save, "checkpoint.async_save"),
    ):
        src.set(key, value, f"config: {name}")
    if not (cfg.monitor.suspicion.enabled and cfg.resilience.replay):
        src.set("suspicions_per_1k", 0.0, "config: monitor.suspicion.enabled / resilience.replay")
    if cfg.checkpoint.every <= 0:
        raise ConfigError("key 'checkpoint.every' must be > 0 for a goodput plan")
    return src


def add_measured(src: Sourced, run_dir: Path) -> None:
    """The run's measured costs that carry over to `src.gpus` GPUs; a note for each that does
    not (a fixed cost of a smaller run, the step time of other hardware)."""
    measured = measured_costs(run_dir)
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    starts = [e for e in events if e["kind"] == "start"]
    world = max((e.get("world_size", 1) for e in starts), default=1)
    used = []
    for key, (value, how) in measured.items():
        # What restarts: the whole job, or one replica group
        ranks = src.gpus // int(src.values["replica_groups"]) if key == "ft_restart_s" else src.gpus
        if key in FIXED and world < ranks:
            src.sources[key] += f" (measured {value:.3g} s at {world} ranks: not used)"
            src.notes.append(
                f"{key} measured {value:.3g} s at {world} ranks in {run_dir}: not used (a fixed "
                f"cost grows with the ranks; only a run of {ranks} or more says it)"
            )
            continue
        src.set(key, value, f"{how} in {run_dir}")
        used.append(key)
    costs = [e for e in events if e["kind"] == "costs" and e.get("median_step_s")]
    if costs:
        device = starts[-1].get("device", "?") if starts else "?"
        src.notes.append(
            f"step time measured {costs[-1]['median_step_s']:.3g} s on {world} rank(s) ({device}) "
            f"in {run_dir}: not used (the plan's step time is `bigtrain plan`'s model of the "
            "config at --gpus on H100-class GPUs)"
        )
    src.notes.append(
        f"from {run_dir}: " + (", ".join(used) if used else "no measurement carries over")
    )


@dataclass
class ModeResult:
    healing: bool
    goodput: float
    band: tuple[float, float]
    best_interval_s: float
    goodput_at_best: float
    lost: dict[str, float]
    mtbf_s: float
    stall_s: float
    ft: bool = False
    """With the replica groups (healing too)."""

    def to_json(self) -> dict:
        return {
            "goodput": round(self.goodput, 5),
            "goodput_band": [round(x, 5) for x in self.band],
            "best_interval_s": round(self.best_interval_s, 2),
            "young_interval_s": round(young_interval(self.stall_s, self.mtbf_s), 2),
            "daly_interval_s": round(daly_interval(self.stall_s, self.mtbf_s), 2),
            "lost_by_cause": {k: round(v, 6) for k, v in self.lost.items()},
            "goodput_at_best": round(self.goodput_at_best, 5),
        }


def run_mode(
    inputs: GoodputInputs, healing: bool, trials: int, seed: int, ft: bool = False
) -> ModeResult:
    """One mode's goodput: healing or plain checkpoint/restart; `ft`: healing with the replica
    groups."""
    p = inputs.sim_params(ft)
    mtbf = inputs.mtbf_s(healing, ft)
    cost = max(p.stall_s, 1e-3)  # sim_params: all of a synchronous save
    center = daly_interval(cost, mtbf) if np.isfinite(mtbf) else 3600.0
    lo = max(inputs.step_s, p.write_s if p.async_save else 0.0)
    grid = np.unique(np.maximum(lo, center * np.geomspace(1 / 32, 32, 41)))
    best = best_interval(grid, simulate(p, grid, healing, trials, seed).mean())
    configured = inputs.ckpt_every_steps * inputs.step_s
    out = simulate(p, np.array([configured, best]), healing, trials, seed)
    per_trial = out.goodput[0]
    return ModeResult(
        healing,
        float(per_trial.mean()),
        (float(np.percentile(per_trial, 5)), float(np.percentile(per_trial, 95))),
        best,
        float(out.goodput[1].mean()),
        out.lost_fractions(0),
        mtbf,
        p.stall_s,
        ft,
    )


def cut_first(src: Sourced, result: ModeResult, trials: int, seed: int) -> list[tuple[str, float]]:
    """Goodput gained by each cut (a cost halved, or the best checkpoint interval), largest first."""
    gains = []
    base = src.inputs()
    for key, factor in CUTS.items():
        changed = dataclasses.replace(base, **{key: getattr(base, key) * factor})
        p = changed.sim_params()
        configured = changed.ckpt_every_steps * changed.step_s
        g = simulate(p, np.array([configured]), result.healing, trials, seed).mean()[0]
        verb = "halve" if factor < 1 else "double"
        gains.append((f"{verb} {key}", float(g - result.goodput)))
    steps = max(1, round(result.best_interval_s / base.step_s))
    gains.append((f"checkpoint.every={steps}", result.goodput_at_best - result.goodput))
    return sorted(gains, key=lambda g: -g[1])


@dataclass
class GoodputPlan:
    src: Sourced
    healing: ModeResult
    plain: ModeResult
    cuts: list[tuple[str, float]]
    ft: ModeResult | None = None
    """With the replica groups; None without (replica_groups 1)."""

    def modes(self) -> list[tuple[str, ModeResult]]:
        """The table's columns: healing, plain checkpoint/restart, and the replica groups."""
        named = [("healing", self.healing), ("plain C/R", self.plain)]
        groups = self.src.values["replica_groups"]
        return named + ([(f"FT groups={groups}", self.ft)] if self.ft else [])

    def to_json(self) -> dict:
        out = self.healing.to_json() | {"plain": self.plain.to_json()}
        if self.ft:
            out["ft"] = self.ft.to_json()
        return out | {
            "cut_first": self.cuts[0][0] if self.cuts and self.cuts[0][1] > 0 else None,
            "inputs": {k: self.src.values[k] for k in KEYS},
            "sources": {k: self.src.sources[k] for k in KEYS},
            "notes": self.src.notes,
        }

    def text(self) -> str:
        src = self.src
        lines = [f"goodput plan at {src.gpus} GPUs; inputs (--set key=value to change):"]
        width = max(len(doc(key)) for key in KEYS)
        for key in KEYS:
            value = src.values[key]
            shown = f"{value:.4g}" if isinstance(value, float) else str(value)
            lines.append(f"  {key:<21} {shown:>9}  {doc(key):<{width}} {src.sources[key]}")
        lines += [f"  note: {note}" for note in src.notes]
        names, modes = zip(*self.modes(), strict=True)
        step = src.values["step_s"]

        def row(label: str, cell) -> str:
            return f"{label:<34}" + "".join(f" {cell(m):>12}" for m in modes)

        lines += [
            "",
            f"{'':<34}" + "".join(f" {name:>12}" for name in names),
            row("goodput (checkpoint.every)", lambda m: f"{m.goodput:.2%}"),
            row("  5-95% of simulated runs", _band),
            row("best checkpoint interval (s)", lambda m: f"{m.best_interval_s:.1f}"),
            row("  in steps", lambda m: _steps(m.best_interval_s / step)),
            row("goodput at the best interval", lambda m: f"{m.goodput_at_best:.2%}"),
            row("Young sqrt(2 C M) (s)", lambda m: f"{young_interval(m.stall_s, m.mtbf_s):.1f}"),
            row("Daly (s)", lambda m: f"{daly_interval(m.stall_s, m.mtbf_s):.1f}"),
            "",
            "wall time lost by cause (fraction of wall time, at checkpoint.every):",
        ]
        lines += [row(f"  {cause}", lambda m, c=cause: f"{m.lost[c]:.3%}") for cause in CAUSES]
        lines += ["", "what to cut first (healing; goodput gained):"]
        lines += [f"  {name:<32} {gain:>+12.3%}" for name, gain in self.cuts[:4]]
        return "\n".join(lines)


def _steps(n: float) -> str:
    """Steps: one decimal while they are few, whole (with separators) when many."""
    return f"{n:.1f}" if n < 100 else f"{n:,.0f}"


def _band(m: ModeResult) -> str:
    return f"{m.band[0]:.1%}-{m.band[1]:.1%}"


def plan_goodput(
    cfg: Config,
    gpus: int,
    run_dir: Path | None = None,
    sets: list[str] | tuple[str, ...] = (),
    trials: int = 200,
    seed: int = 0,
) -> GoodputPlan:
    if gpus < 1:
        raise ConfigError(f"--gpus got {gpus}, expected a positive integer")
    try:
        sm90 = Hardware("cuda", "sm90", cuda_capability=(9, 0))
        run = planned(cfg, gpus, sm90, global_batch=False)
    except ConfigError as e:
        raise ConfigError(f"--gpus {gpus} is not a multiple of the config's mesh: {e}") from None
    src = config_inputs(run, gpus)
    if run_dir is not None:
        add_measured(src, run_dir)
    src.override(list(sets))
    inputs = src.inputs()
    healing = run_mode(inputs, True, trials, seed)
    plain = run_mode(inputs, False, trials, seed)
    ft = None
    if inputs.replica_groups > 1:
        check_groups(run, gpus, inputs.replica_groups)
        ft = run_mode(inputs, True, trials, seed, ft=True)
    return GoodputPlan(src, healing, plain, cut_first(src, healing, trials, seed), ft)


def check_groups(run: PlannedRun, gpus: int, groups: int) -> None:
    """ConfigError naming replica_groups unless `gpus` split into `groups` jobs that each hold a
    model copy under the config's mesh."""
    if gpus % groups:
        raise ConfigError(
            f"replica_groups ({groups}) must divide --gpus ({gpus}): each group holds a whole "
            "model copy over gpus / replica_groups GPUs"
        )
    try:
        Layout.of(run.cfg.parallel, gpus // groups)
    except ConfigError as e:
        raise ConfigError(
            f"replica_groups ({groups}): a group of {gpus // groups} GPUs: {e}"
        ) from None
