"""The healing sections: `monitor.*` (the gradient statistics, the spike rules, the actions) and
`resilience.*` (rollback targets, the ladder, replay, the watchdog), and the checks of the rules'
keys that the types alone do not make (called by config/load.py's `validate`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from bigtrain.errors import ConfigError

SPIKE_RULES = ("loss", "grad_norm", "router_collapse", "router_logits", "router_spread")
"""The series a spike rule may watch (`monitor.rules`)."""


@dataclass
class SpikeRuleConfig:
    """One spike rule (bigtrain/resilience/rules.py): a value is a spike when it is at least
    `factor` times the median of the last `window` healthy values and, from `min_values` values
    on, also more than `sigmas` robust standard deviations above it in log space."""

    window: int = 50
    """Healthy values the baseline (their median) and spread are taken from."""
    factor: float = 1.5
    """The least ratio to the baseline that is a spike (> 1)."""
    sigmas: float = 6.0
    """Robust standard deviations (1.4826 x MAD of the log values) above the baseline that a
    spike must also exceed, from `min_values` values on; 0: the factor alone."""
    min_values: int = 10
    """Values in the window before the spread counts (it is unreliable on fewer); the factor
    applies from the first value on, so step 2 is already watched."""


@dataclass
class SuspicionConfig:
    """The suspicion tier (resilience/suspicion.py): a gradient shard that rose over its own
    history beyond the other ranks' shards of the same tensor, beyond its rank's other shards and
    beyond its closest companion, while no other tensor rose nearly as much, replays the step,
    nothing else."""

    enabled: bool = True
    """Watch every gradient tensor's shards each step (one more small MAX all-reduce) and replay
    a suspicious step; needs resilience.replay."""
    factor: float = 5.0
    """The least jump of a tensor's split (its shards' largest rise over their own history
    minus the smallest; a lone holder's rise), as a ratio of gradient norms (> 1)."""
    sigmas: float = 3.0
    """Robust standard deviations (of the split's own log history) a jump must also exceed
    once `min_values` values are known."""
    alone_factor: float = 3.0
    """The least jump of a shard's rise beyond the median rise of its rank's shards, as a
    ratio of gradient norms (> 1); a tensor must pass all three series."""
    alone_sigmas: float = 1.5
    """Robust standard deviations of that series' history it must also exceed."""
    pair_factor: float = 4.0
    """The least jump of a shard's rise beyond its partner's (the neighbour, within
    `neighbours`, whose level moved most like its own over the window), as a ratio of gradient
    norms (> 1)."""
    pair_sigmas: float = 1.5
    """Robust standard deviations of that series' history it must also exceed."""
    neighbours: int = 4
    """Tensors registered just before and after a tensor (its layer's others) among which its
    partner is chosen."""
    excursion: float = 1.0
    """A jump must also exceed this many times the largest rise over its median that the
    series' window holds (the tensor's own recent healthy excursions); 0: off."""
    lone_share: float = 0.5
    """A tensor one rank holds whole (one process, DDP, a small tensor) has no split: its split
    series is its own rise, whose history carries every move of its rank's gradient that the
    alone series takes out. Its jump must exceed this share of that history's margins (the
    excursion's and the sigmas'; never less than `factor`); 1: the margins of a split."""
    lead: float = 1.75
    """How many times a suspicious tensor's jump must exceed any other tensor's in the same step
    (>= 1), each jump measured in its own tensor's margins (the lesser of its split's and its
    alone's jump over their margins): one tensor moved, not a layer waking up or a loss spike."""
    rival_share: float = 0.5
    """Another tensor counts against a lead only when its split and alone jumps reached this
    share of their own margins (0: every tensor): a volatile tensor's ordinary noise, far within
    its margins, does not hide a corruption elsewhere."""
    company: float = 1.0
    """No other tensor's split and alone jumps may reach this share of their own margins in the
    step (inf: off): a corruption moves one tensor; the data moves a tensor's consumers with it
    (a position table's jump with the first block's experts)."""
    window: int = 20
    """Healthy steps of history per tensor (and of each rank's shard levels)."""
    min_values: int = 10
    """Values in the history before the spread counts; until then the factor and the largest
    excursion the history holds."""


@dataclass
class ChecksumConfig:
    """Gradient checksums (monitor/checksums.py): each covered gradient checked against its
    layer's inputs and output gradients (dW·r = dYᵀ(X·r) for a random ±1 vector r); a mismatch
    replays the step as a suspicion does. They need no history, so they catch a corrupted tensor
    in warm-up, where healthy tensors move as much as a fault would."""

    enabled: bool = True
    """Check the gradients of linear layers, embeddings and norms (one process and FSDP2 without
    tensor, context, expert or pipeline parallelism, replica groups or compile; elsewhere off,
    and the start event says why); needs resilience.replay."""
    until_step: int = 200
    """Check steps 1..N only (-1: every step): the warm-up, where the suspicion tier's histories
    are short. Each checked step costs two matrix-vector products per covered layer in forward
    and backward (bench/overhead.py measures it); later steps are the suspicion tier's."""
    tolerance: float = 0.2
    """The largest relative difference of a tensor's check vectors (per shard) that is rounding:
    the detection bench's healthy runs stayed below 0.05 (BF16; FP32 below 1e-5); a tensor
    scaled x1.25 is 0.2, x2 0.5, x10 0.9, so x10 and x50 are caught as with any tolerance up to
    0.85, and healthy rounding has 4x of room."""


@dataclass
class MonitorConfig:
    every: int = 10
    """Full per-tensor statistics (max |g| per tensor: per-layer telemetry) every N steps and at
    every log step. Other steps compute only the sums of squares and non-finite counts, which give
    the global norm, the clipping, the non-finite check and the spike rules (those run every
    step); an anomaly's report computes max |g| when its step did not. With the Triton kernel max
    |g| comes free; N then only saves a MAX all-reduce."""
    kernel: str = "auto"
    """Statistics pass: `auto` (Triton on CUDA, torch foreach elsewhere), `triton` (CUDA only) or
    `torch`. Read at start."""
    nonfinite: str = "rollback"
    """What a non-finite loss or gradient does (the step is never applied): `rollback` (to the last
    good state, see resilience.*), `skip` (anomaly event, training goes on) or `abort` (anomaly
    event, ABORTED marker, exit 3). FP16 overflows under dynamic loss scaling are not anomalies:
    the scale backs off. HSDP replicas whose gradient shards differ (compared every `every`
    steps) take the same action."""
    rules: list[str] = field(
        default_factory=lambda: ["loss", "grad_norm", "router_logits", "router_spread"]
    )
    """Spike rules that may trigger the ladder (`monitor.on_spike`): `loss`, `grad_norm` (the
    global gradient norm), for mixture-of-experts models (idle on a dense model)
    `router_logits` (the worst MoE layer's router z-loss), `router_spread` (the worst layer's
    disagreement between the step's forwards: one rank's routers off) and, opt-in,
    `router_collapse` (the worst layer's load-balancing loss: off by default, it rolled back a
    healthy tiny MoE run in warm-up, see its key); [] turns spike detection off (non-finite
    values are always caught).
    Per-tensor statistics never trigger: in healthy runs a single tensor's gradient norm jumps
    1000x when attention wakes up; they name the culprits in the anomaly event (docs/healing.md:
    the rules and the sweep that chose them)."""
    loss: SpikeRuleConfig = field(default_factory=SpikeRuleConfig)
    """The loss rule: over the healthy sweep the loss stayed within 1.07x of its recent median,
    so 1.5x with 6 robust sigmas has a wide margin and still catches a x10 loss spike on one
    rank of 16."""
    grad_norm: SpikeRuleConfig = field(
        default_factory=lambda: SpikeRuleConfig(window=50, factor=1000.0, sigmas=0.0)
    )
    """The gradient-norm rule: a guard against gross corruption only, by the factor alone.
    Healthy runs jump 53-74x in warm-up (clipping does its job there), so a sensitive threshold
    would roll back healthy runs; the spread of such a warm-up would lift a sigma threshold past
    20000x."""
    router_collapse: SpikeRuleConfig = field(default_factory=SpikeRuleConfig)
    """The router-collapse rule (MoE; not in monitor.rules by default): the load-balancing loss
    is 1.0 when the router spreads tokens and probabilities evenly and grows towards experts /
    top_k as they pile onto a few experts. Healthy micro MoE runs kept it within 1.25x of its
    median, but a healthy tiny one reached 1.51x in warm-up (step 27), as high as the
    router-bias drill on one of two ranks (1.54x): no threshold parts them, so it is opt-in
    (docs/moe.md)."""
    router_logits: SpikeRuleConfig = field(
        default_factory=lambda: SpikeRuleConfig(window=50, factor=4.0, sigmas=6.0)
    )
    """The runaway-logits rule (MoE): the router z-loss (mean squared log-sum-exp of the
    logits) at 4x its median: logits doubled in a step. Healthy runs let it fall steadily."""
    router_spread: SpikeRuleConfig = field(
        default_factory=lambda: SpikeRuleConfig(window=50, factor=8.0, sigmas=4.0)
    )
    """The one-rank router rule (MoE): the worst layer's spread over the step's forwards (every
    micro-batch on every rank) of an expert's importance, its mean score, in units of the
    score's spread over a forward's tokens (monitor/routers.py). Forwards of one step run the
    same router on samples of the same data, so they agree up to sampling noise, and a rank
    whose routers compute something else stands out however many ranks average it away.
    Healthy micro MoE runs kept it within 4.8x of its median (0.15-0.29); the router-bias drill
    on one of two ranks raised it 60-700x (docs/moe.md)."""
    suspicion: SuspicionConfig = field(default_factory=SuspicionConfig)
    """The suspicion tier below the rules: per-tensor statistics that replay a step, which then
    tells silent data corruption (the replay differs) from the data's own spikes."""
    checksum: ChecksumConfig = field(default_factory=ChecksumConfig)
    """Gradient checksums beside the magnitude tiers (monitor/checksums.py)."""
    tensor_window: int = 20
    """Healthy steps of per-tensor norms kept to name the tensors that jumped most in an anomaly
    event (`top_jumps`: norm / median of its window)."""
    on_spike: str = "rollback"
    """What a spike does: `rollback` (see resilience.*), `skip` the optimizer step, or `warn`
    (anomaly event only; the step is applied)."""
    max_consecutive: int = 5
    """Stop with exit 3 after this many anomalous steps in a row (a shift no skip can fix)."""
    top_k: int = 5
    """Tensors named in an anomaly event (by max |g| and by non-finite count)."""
    timing_every: int = 50
    """Every N steps the ranks share their step time split into data, forward+backward, optimizer
    and other (one small all-gather): per-rank times in metrics, `straggler` events. 0: off."""
    straggler_factor: float = 1.3
    """A rank whose part of the step takes this many times the median of the other ranks' (and
    20% of the step more) on 2 timing steps in a row is a straggler (callbacks/straggler.py)."""


@dataclass
class ResilienceConfig:
    snapshot_every: int = 25
    """Every N steps each rank copies its shard of master weights and optimizer state, the loss
    scaler, schedule, data cursor, skip windows and RNG to host memory; 0: no snapshots (a rollback
    then goes to the newest good disk checkpoint)."""
    snapshots: int = 3
    """Snapshots kept in host memory (a ring)."""
    confirm_steps: int = 10
    """Healthy steps that must follow a snapshot before it counts as good."""
    skip_margin: int = 0
    """Samples skipped beyond the anomaly's batch, on top of the window from the restored cursor
    to the anomaly."""
    lr_backoff: float = 0.5
    """The learning rate is multiplied by this after a rollback (compounding on repeats)."""
    clip_backoff: float = 0.5
    """The clipping threshold is multiplied by this after a rollback (tighter clipping)."""
    lr_cooldown_steps: int | None = None
    """How long the back-off lasts, in steps after the restored step, never past train.max_steps.
    None: twice the steps the rollback went back (the stretch that led into the anomaly gets
    its length again at the lower LR, then some); 0: for the rest of the run."""
    window: int = 50
    """An anomaly within this many steps of the previous rollback goes one snapshot further back."""
    max_rollbacks: int = 5
    """More rollbacks than this in a run stop it with exit 3 (the last good checkpoint is kept)."""
    replay: bool = True
    """On a non-finite or spike anomaly, run the same micro-batches again from the same state
    first: a clean replay is a transient fault (the step goes on, nothing skipped), a reproduced
    anomaly takes the action above."""
    max_transient_per_rank: int = 3
    """After this many transient faults on one host, stop with exit 6 and its name in
    RUN_DIR/excluded_hosts.txt (requeue without it)."""
    hang_timeout_s: float | None = None
    """No step finishing within this long is a hang: stacks to RUN_DIR/hang/, exit 5. None: 10x
    the median step time (at least 300 s) after 20 steps, parallel.timeout_s before."""


SUSPICION_NONNEGATIVE = (
    "alone_sigmas",
    "pair_sigmas",
    "excursion",
    "lone_share",
    "rival_share",
)


def check_rules(monitor: MonitorConfig) -> None:
    """Spike rules: known names, and settings that can fire at all."""
    unknown = [name for name in monitor.rules if name not in SPIKE_RULES]
    if unknown:
        raise ConfigError(
            f"key 'monitor.rules' got unknown rule names {unknown}, expected a list of "
            f"{', '.join(SPIKE_RULES)}"
        )
    suspicion = monitor.suspicion
    bounds = [(k, lambda v: v > 1.0, "> 1") for k in ("alone_factor", "pair_factor")]
    bounds += [(k, lambda v: v >= 0.0, ">= 0") for k in SUSPICION_NONNEGATIVE]
    bounds += [("company", lambda v: v > 0.0, "> 0 (inf: off)")]
    bounds += [(k, lambda v: v >= 1, ">= 1") for k in ("lead", "neighbours")]
    for key, ok, expected in bounds:
        if not ok(getattr(suspicion, key)):
            raise ConfigError(
                f"key 'monitor.suspicion.{key}' got {getattr(suspicion, key)}, expected a value "
                f"{expected}"
            )
    checksum = monitor.checksum
    if not 0.0 < checksum.tolerance < 1.0:
        raise ConfigError(
            f"key 'monitor.checksum.tolerance' got {checksum.tolerance}, expected a value in "
            "(0, 1): a relative difference of check vectors"
        )
    if checksum.until_step < -1:
        raise ConfigError(
            f"key 'monitor.checksum.until_step' got {checksum.until_step}, expected a step "
            ">= 0 or -1 (every step)"
        )
    for name in (*SPIKE_RULES, "suspicion"):  # the suspicion tier has the same four settings
        rule, key = getattr(monitor, name), f"monitor.{name}"
        if rule.window < 1:
            raise ConfigError(f"key '{key}.window' got {rule.window}, expected a value >= 1")
        if not rule.factor > 1.0:
            raise ConfigError(f"key '{key}.factor' got {rule.factor}, expected a value > 1")
        if not rule.sigmas >= 0.0:
            raise ConfigError(f"key '{key}.sigmas' got {rule.sigmas}, expected a value >= 0")
        if not 1 <= rule.min_values <= rule.window:
            raise ConfigError(
                f"key '{key}.min_values' got {rule.min_values}, expected 1..{key}.window "
                f"({rule.window}): a window shorter than the values it waits for never fires"
            )
