"""The fault sweep of bench/detection.py, simulated exactly on the healthy runs' traces.

A fault injected on rank r at step s changes only what rank r contributes to the monitor's SUM
all-reduce: its loss and its row half of each gradient's sum of squares. So from a healthy trace
(per step: both ranks' losses, both halves of every tensor) the reduced numbers of every faulty
step follow without training, and bigtrain's own Detector (bigtrain/resilience/detect.py), its
windows filled with the healthy steps before s, gives the verdict. Only step s is seen: a fault
missed there is counted as missed (the real runs of detection_runs.validate show what follows).

Kinds, as the drills of bigtrain/callbacks/drills.py inject them on rank r:
    nan_grad, inf_grad   one value of the first gradient r holds a part of
    nan_loss             r's loss and every gradient it holds
    spike_xF             r's loss and all its gradient halves x F (a bad batch: drill.spike_step)
    loss_spike_xF        r's reported loss x F
    grad_spike_xF        one tensor's half on r x F, averaged over every tensor (but those whose
                         exact gradient is 0: model/gpt.py gradient_roles); grad_spike_first
                         is the drill's default tensor (the first one r holds); on the first
                         execution only (silent data corruption, as drill.grad_spike)
    bitflip              one exponent bit of the top four (FP32 bits 30-27) of one value of one
                         tensor's half on r flips, first execution only; the value is taken as
                         the half's root mean square, and only flips that raise it count (the
                         others shrink one value, harmless)

A step is caught by an anomaly, or, for the first-execution-only kinds, by a suspicion (the
suspicion tier, bigtrain/resilience/suspicion.py: its replay comes out clean, a transient) or by
a gradient checksum mismatch (bigtrain/monitor/checksums.py) on the steps the run checked: the
trace holds each tensor half's healthy residual, and a fault's residual follows from it as a
lower bound (scaled_check, flipped_check). A bad batch (spike_xF) scales what the checksums
compare on both sides alike: it leaves them as recorded.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
from detection_runs import RANKS, STYLES, TINY, Trace

from bigtrain.config import load_config
from bigtrain.config.schema import MonitorConfig
from bigtrain.model.gpt import gradient_roles
from bigtrain.monitor.checksums import mismatched
from bigtrain.monitor.monitor import Health
from bigtrain.monitor.shards import EMPTY, PAIR_MIN_VALUES
from bigtrain.resilience.detect import Detector

FACTORS = (10, 50)
SCALED = ("spike", "loss_spike", "grad_spike", "grad_spike_first")
KINDS = ("nan_grad", "inf_grad", "nan_loss") + tuple(f"{k}_x{f}" for k in SCALED for f in FACTORS)
KINDS += ("bitflip",)
FIRST_RUN_ONLY = ("grad_spike", "grad_spike_first", "bitflip")  # a replay comes out clean
BITS = (30, 29, 28, 27)  # FP32's top exponent bits
PER_TENSOR = ("grad_spike_x", "bitflip")
FIRST_STEP = 2  # faults are drawn from [2, steps]: step 1 has no history, only the NaN check


@dataclass
class Faulty:
    """Rank-level inputs of one step: both ranks' losses and per-tensor halves, as changed."""

    micro_loss: np.ndarray  # [..., rank]
    halves: np.ndarray  # [..., tensor, rank] sums of squares
    nonfinite: np.ndarray  # [..., tensor] non-finite values
    telemetry: dict = field(default_factory=dict)  # an MoE step's router numbers (unchanged)
    checks: np.ndarray | None = None
    """[tensor, rank] the gradient checksums' residual of each half (NaN: unchecked)."""

    def covered(self) -> list[int]:
        """The tensors whose checksums this step checks."""
        if self.checks is None:
            return []
        return [int(t) for t in np.flatnonzero(np.isfinite(self.checks).any(axis=-1))]

    def mismatches(self, names: list[str], tolerance: float) -> list[list]:
        """The checksum mismatches the monitor would report (monitor/checksums.py): per tensor
        the largest residual of its halves."""
        covered = self.covered()
        if not covered:
            return []
        worst = np.full(len(names), np.nan)
        worst[covered] = np.nanmax(self.checks[covered], axis=-1)
        return mismatched(names, worst.tolist(), covered, tolerance)

    def health(self, ranks: RankShards | None = None) -> Health:
        """The monitor's reduced numbers (monitor.py: SUM over ranks, loss / world size; with
        the emulated ranks' shard histories, the suspicion tier's statistics)."""
        sum_sq = self.halves.sum(axis=1)
        num_nonfinite = int(self.nonfinite.sum())
        return Health(
            None,  # type: ignore[arg-type]  # device tensors: the Detector reads host values only
            None,  # type: ignore[arg-type]
            None,  # type: ignore[arg-type]
            host_loss=float(self.micro_loss.mean()),
            host_grad_norm=math.sqrt(float(sum_sq.sum())),
            num_nonfinite=num_nonfinite,
            host_sum_sq=sum_sq.tolist(),
            host_nonfinite=self.nonfinite.tolist(),
            host_max_abs=None,
            replicas=[],
            telemetry=dict(self.telemetry),
            shards=None if ranks is None else ranks.shards(self.halves),
        )


def lower_median(values: np.ndarray, axis: int) -> np.ndarray:
    """torch's nanmedian in NumPy: the lower middle value for an even count, NaN ignored (NaN
    where all are)."""
    ordered = np.sort(values, axis=axis)  # NaN last
    count = np.sum(~np.isnan(values), axis=axis, keepdims=True)
    picked = np.take_along_axis(ordered, np.maximum(count - 1, 0) // 2, axis=axis)
    return np.squeeze(np.where(count > 0, picked, np.nan), axis=axis)


def partners(values: np.ndarray, neighbours: int) -> tuple[np.ndarray, np.ndarray]:
    """bigtrain/monitor/shards.py's `partners` in NumPy (the same offsets, medians and ties)."""
    num = values.shape[1]
    offsets = np.array([o for d in range(1, neighbours + 1) for o in (-d, d)])
    columns = np.arange(num)[None] + offsets[:, None]
    inside = (columns >= 0) & (columns < num)
    columns = np.clip(columns, 0, max(num - 1, 0))
    with np.errstate(invalid="ignore"):
        diff = values[:, None, :] - values[:, columns]
        center = lower_median(diff, axis=0)
        spread = lower_median(np.abs(diff - center), axis=0)
    spread = np.where(inside & np.isfinite(spread), spread, np.inf)
    best = np.argmin(spread, axis=0)[None]
    found = np.isfinite(np.take_along_axis(spread, best, 0)[0])
    partner = np.where(found, np.take_along_axis(columns, best, 0)[0], -1)
    return partner, np.where(found, np.take_along_axis(center, best, 0)[0], np.nan)


class RankShards:
    """The emulated ranks' side of the suspicion tier (bigtrain/monitor/shards.py in NumPy, the
    same medians and partners): each rank's history of accepted shard levels, and its statistics
    of a step reduced over the ranks as the MAX all-reduce does."""

    def __init__(self, sizes: np.ndarray, window: int, neighbours: int = 4) -> None:
        self.sizes = sizes  # [tensor, rank]
        self.neighbours = neighbours
        self.history: deque[np.ndarray] = deque(maxlen=window)
        self.count = 0  # levels accepted so far, as the device ring counts them
        self.center = np.full(sizes.shape, np.nan)
        self.partner = np.full(sizes.shape, -1)
        self.pair_center = np.full(sizes.shape, np.nan)

    def levels(self, halves: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            logs = np.log(np.maximum(halves / np.maximum(self.sizes, 1), 1e-38))
        return np.where((self.sizes > 0) & np.isfinite(logs), logs, np.nan)

    def shards(self, halves: np.ndarray) -> list[float]:
        """Health.shards of a step with these halves."""
        levels = self.levels(halves)
        rise = levels - self.center
        alone = rise - lower_median(rise, axis=0)[None, :]
        paired = np.take_along_axis(levels, np.maximum(self.partner, 0), axis=0)
        pair = np.where(self.partner >= 0, levels - paired - self.pair_center, np.nan)
        pair = np.where(np.isfinite(pair), pair, alone)

        def most(values: np.ndarray) -> np.ndarray:
            return np.where(np.isnan(values), EMPTY, values).max(axis=1)

        return np.concatenate([most(rise), most(-rise), most(alone), most(pair)]).tolist()

    def accept(self, halves: np.ndarray) -> None:
        self.history.append(self.levels(halves))
        self.count += 1
        ring = np.stack(self.history)
        self.center = lower_median(ring, axis=0)
        if self.count >= PAIR_MIN_VALUES:
            chosen = [partners(ring[:, :, r], self.neighbours) for r in range(ring.shape[2])]
            self.partner = np.stack([c[0] for c in chosen], axis=1)
            self.pair_center = np.stack([c[1] for c in chosen], axis=1)


def _flip(value: float, bit: int) -> float:
    word = np.array([value], dtype=np.float32).view(np.int32)
    word ^= np.int32(1 << bit)
    return float(np.abs(word.view(np.float32)[0]))


def inject(kind: str, step: Faulty, rank: int, sizes: np.ndarray, tensor: int = 0) -> Faulty:
    """`step` (one step, or every step stacked on a leading axis) with `kind` injected on
    `rank`; `sizes[t, r]`: values of tensor t on rank r; `tensor`: grad_spike's tensor."""
    loss, halves = step.micro_loss.copy(), step.halves.copy()
    nonfinite = step.nonfinite.copy()
    held = sizes > 0
    first = int(np.flatnonzero(held[:, rank])[0])
    name, _, factor = kind.partition("_x")
    factor = float(factor) if factor else 1.0
    if name in ("nan_grad", "inf_grad"):
        halves[..., first, rank] = math.nan if name == "nan_grad" else math.inf
        nonfinite[..., first] += 1
    elif name == "nan_loss":
        loss[..., rank] = math.nan
        halves[..., held[:, rank], rank] = math.nan
        nonfinite += sizes[:, rank]
    elif name == "spike":
        loss[..., rank] *= factor
        halves[..., rank] *= factor**2
    elif name == "loss_spike":
        loss[..., rank] *= factor
    else:
        hit = first if name == "grad_spike_first" else tensor
        halves[..., hit, rank] *= factor**2
        return Faulty(
            loss, halves, nonfinite, step.telemetry, scaled_check(step, hit, rank, factor)
        )
    return Faulty(loss, halves, nonfinite, step.telemetry, step.checks)


def scaled_check(step: Faulty, tensor: int, rank: int, factor: float) -> np.ndarray | None:
    """The checksums' residual of a tensor half whose gradient a fault multiplied by `factor`.
    Observed O = E + d with |d| = rho max(|O|, |E|) (the healthy residual rho) becomes F O, so
    |F O - E| >= (F - 1)|E| - F|d| over max(F|O|, |E|) <= F(|E| + |d|): at least
    ((F - 1) - F rho) / (F (1 + rho)), the value taken (a lower bound: never an easier catch)."""
    if step.checks is None:
        return None
    checks = step.checks.copy()
    rho = checks[..., tensor, rank]
    checks[..., tensor, rank] = np.maximum(((factor - 1) - factor * rho) / (factor * (1 + rho)), 0)
    return checks


def flipped_check(step: Faulty, tensor: int, rank: int, change: float) -> np.ndarray | None:
    """The residual of a half one of whose values moved by `change`: its check vector moves by
    |change| in one row, against a vector whose norm is about the half's gradient norm (a ±1
    probe), less the healthy residual (a lower bound)."""
    if step.checks is None:
        return None
    checks = step.checks.copy()
    norm_sq = step.halves[tensor, rank]
    moved = abs(change) / math.sqrt(norm_sq + change * change)
    checks[tensor, rank] = max(moved - checks[tensor, rank], 0.0)
    return checks


def healthy_steps(trace: Trace) -> list[Faulty]:
    n = len(trace.names)
    routers = trace.routers or [{}] * len(trace.loss)
    checks = trace.checks or [None] * len(trace.loss)
    return [
        Faulty(np.asarray(m), h, np.zeros(n), r, c)
        for m, h, r, c in zip(trace.micro_loss, trace.halves, routers, checks, strict=True)
    ]


def cache_thresholds(detector: Detector) -> None:
    """A rule's threshold changes only when a value joins its window: computed once per step by
    the rule's own code, instead of once for each of the step's hundred simulated faults."""
    for rule in detector.rules.values():
        compute, add, cache = rule.threshold, rule.add, {}

        def threshold(compute=compute, cache=cache):
            if "value" not in cache:
                cache["value"] = compute()
            return cache["value"]

        def add_value(value, add=add, cache=cache):
            cache.clear()
            add(value)

        rule.threshold, rule.add = threshold, add_value


@dataclass
class Simulated:
    """Per trace: which faults the Detector caught at their step."""

    caught: dict[str, np.ndarray] = field(default_factory=dict)  # kind -> [step, rank(, tensor)]
    false_alarms: list[int] = field(default_factory=list)  # healthy steps the Detector flagged
    suspicions: list[int] = field(default_factory=list)  # healthy steps the suspicion tier replays


def simulate(trace: Trace, cfg: MonitorConfig, kinds: tuple[str, ...] = KINDS) -> Simulated:
    """Every kind on every rank at every step from FIRST_STEP on, judged by a Detector whose
    windows hold the trace's healthy steps before it (flagged steps stay out, as in a run)."""
    model = load_config([TINY], STYLES[trace.spec.style]).model
    detector = Detector(cfg, trace.names, gradient_roles(trace.names, model))
    cache_thresholds(detector)
    steps, ranks = healthy_steps(trace), range(trace.sizes.shape[1])
    check = cfg.checksum
    for step, faulty in enumerate(steps, start=1):  # the checksums of these settings' steps
        if not check.enabled or 0 <= check.until_step < step:
            faulty.checks = None
    shards = RankShards(trace.sizes, cfg.suspicion.window, cfg.suspicion.neighbours)
    out = Simulated()
    caught = {k: [] for k in kinds}
    for index, healthy in enumerate(steps):
        step = index + 1
        if step >= FIRST_STEP:
            for kind in kinds:
                caught[kind].append([_caught(detector, kind, healthy, r, shards) for r in ranks])
        health = healthy.health(shards)
        if detector.verdict(health, loss_scaled=False).anomaly is not None:
            out.false_alarms.append(step)
        else:
            tolerance = cfg.checksum.tolerance
            if detector.suspects(health) or healthy.mismatches(trace.names, tolerance):
                out.suspicions.append(step)  # replayed, reproduced, applied
            detector.add(health)
            shards.accept(healthy.halves)
    out.caught = {k: np.asarray(v) for k, v in caught.items()}
    return out


def one_process(trace: Trace) -> Trace:
    """The trace as one process saw it: each tensor one shard, the whole gradient (its halves
    summed), the loss the ranks' mean; a fault on the one rank multiplies the whole tensor."""
    return replace(
        trace,
        micro_loss=[[float(np.mean(m))] for m in trace.micro_loss],
        halves=[h.sum(axis=1, keepdims=True) for h in trace.halves],
        sizes=trace.sizes.sum(axis=1, keepdims=True),
        checks=[w[:, None] for w in trace.checks_whole],  # the whole tensor's, as the run's
    )


def _caught(detector: Detector, kind: str, healthy: Faulty, rank: int, shards: RankShards):
    """True if the fault is caught; for grad_spike, per tensor (a tensor the rank holds no part
    of cannot be poisoned on it: NaN, left out of the average)."""

    replay_clears = kind.partition("_x")[0] in FIRST_RUN_ONLY
    sizes = shards.sizes
    names, tolerance = detector.names, detector.cfg.checksum.tolerance

    def found(faulty: Faulty) -> bool:
        health = faulty.health(shards)
        if detector.verdict(health, loss_scaled=False).anomaly is not None:
            return True
        if not replay_clears:
            return False
        return bool(detector.suspects(health) or faulty.mismatches(names, tolerance))

    def caught(tensor: int = 0) -> bool:
        return found(inject(kind, healthy, rank, sizes, tensor))

    def flips(tensor: int) -> float:
        """The share of raising flips of the top exponent bits caught (NaN: none raises)."""
        value = math.sqrt(healthy.halves[tensor, rank] / sizes[tensor, rank])
        hits = []
        for bit in BITS:
            new = _flip(value, bit)
            if not new > value:  # shrinks one value: harmless
                continue
            halves = healthy.halves.copy()
            halves[tensor, rank] += new * new - value * value
            checks = flipped_check(healthy, tensor, rank, new - value)
            faulty = Faulty(
                healthy.micro_loss, halves, healthy.nonfinite, healthy.telemetry, checks
            )
            hits.append(found(faulty))
        return float(np.mean(hits)) if hits else math.nan

    # A tensor whose exact gradient is 0 (attention's key bias) is not drilled: nothing the model
    # computes depends on it, and the tier ignores it (model/gpt.py gradient_roles).
    drilled = [bool(sizes[t, rank]) and detector.suspicion.watched[t] for t in range(len(sizes))]
    if kind == "bitflip":
        return [flips(t) if drilled[t] else math.nan for t in range(len(sizes))]
    if not kind.startswith("grad_spike_x"):
        return caught()
    return [caught(t) if drilled[t] else math.nan for t in range(len(sizes))]


# --- candidate rules, for comparison: small threshold functions of the values before a step -----

History = Callable[[np.ndarray], "float | np.ndarray"]


def mean_std(sigmas: float, window: int, min_values: int) -> History:
    def threshold(values: np.ndarray) -> float:
        if len(values) < min_values:
            return math.nan
        recent = values[-window:]
        return float(recent.mean() + sigmas * recent.std())

    return threshold


def max_ratio(factor: float) -> History:
    return lambda values: factor * float(values.max()) if len(values) else math.nan


def median_ratio(factor: float, window: int, from_step: int = 2) -> History:
    """factor x the median of the last `window` values, from step `from_step` on; per column
    for a [step, tensor] history."""

    def threshold(values: np.ndarray):
        if len(values) + 1 < max(from_step, 2):
            return np.full(values.shape[1:], math.nan) if values.ndim > 1 else math.nan
        return factor * np.median(values[-window:], axis=0)

    return threshold


@dataclass(frozen=True)
class Candidate:
    """A rule that fires when any of its series exceeds its threshold."""

    name: str
    loss: History | None = None
    grad_norm: History | None = None
    tensor: History | None = None  # per-tensor norms


CANDIDATES = (
    Candidate(
        "olmo: mean + 6 std of last 128 (from 20), loss or grad norm",
        loss=mean_std(6, 128, 20),
        grad_norm=mean_std(6, 128, 20),
    ),
    Candidate("megatron: loss > 10x the max seen", loss=max_ratio(10)),
    Candidate("grad norm > 5x median of last 50", grad_norm=median_ratio(5, 50)),
    Candidate("grad norm > 20x median of last 50", grad_norm=median_ratio(20, 50)),
    Candidate("grad norm > 100x median of last 50", grad_norm=median_ratio(100, 50)),
    Candidate(
        "tensor norm > 20x its median of last 20 (from step 100)",
        tensor=median_ratio(20, 20, from_step=100),
    ),
)
SPIKES = tuple(k for k in KINDS if any(k.startswith(s) for s in SCALED))


@dataclass
class Judged:
    """A candidate on one trace: healthy steps it flags, and the faults it catches."""

    false_alarms: list[int]
    caught: dict[str, np.ndarray]  # spike kind -> [step, rank(, tensor)], from FIRST_STEP


def judge(candidate: Candidate, trace: Trace) -> Judged:
    """The candidate's thresholds at each step, from every healthy value before it (a candidate
    has no healer: the values it flags stay in its history), applied to the healthy values and
    to each spike kind's faulty values on each rank."""
    stacked = Faulty(
        np.asarray(trace.micro_loss), np.stack(trace.halves), np.zeros((1, len(trace.names)))
    )
    series = _series(stacked)
    limits = {}
    for metric, values in series.items():
        rule = getattr(candidate, metric)
        if rule is not None:
            limits[metric] = np.stack([np.asarray(rule(values[:i])) for i in range(len(values))])

    def fires(faulty: Faulty) -> np.ndarray:
        out = np.zeros(len(stacked.micro_loss), dtype=bool)
        for metric, values in _series(faulty).items():
            if metric in limits:
                above = values > limits[metric]
                out |= above.any(axis=1) if above.ndim > 1 else above
        return out

    def caught_on(kind: str, rank: int) -> np.ndarray:
        """[step], or [step, tensor] for grad_spike (NaN: the rank holds none of the tensor)."""
        if not kind.startswith("grad_spike_x"):
            return fires(inject(kind, stacked, rank, trace.sizes)).astype(float)
        held = trace.sizes[:, rank] > 0
        columns = [
            fires(inject(kind, stacked, rank, trace.sizes, t)) if held[t] else np.nan
            for t in range(len(held))
        ]
        return np.stack(np.broadcast_arrays(*columns), axis=1).astype(float)

    first = FIRST_STEP - 1
    caught = {
        kind: np.stack([caught_on(kind, r) for r in range(RANKS)], axis=1)[first:]
        for kind in SPIKES
    }
    flagged = np.flatnonzero(fires(stacked)[first:]) + FIRST_STEP
    return Judged([int(s) for s in flagged], caught)


def _series(faulty: Faulty) -> dict[str, np.ndarray]:
    """What the candidates read at every step: loss, global gradient norm, per-tensor norms."""
    sum_sq = faulty.halves.sum(axis=-1)
    return {
        "loss": faulty.micro_loss.mean(axis=-1),
        "grad_norm": np.sqrt(sum_sq.sum(axis=-1)),
        "tensor": np.sqrt(sum_sq),
    }
