"""Fault-injection switches (`drill.*`), for drills and tests; all off by default. Kept apart from
the user settings: nothing here belongs in a real run's config."""

from __future__ import annotations

from dataclasses import dataclass, field

from bigtrain.errors import ConfigError


@dataclass
class DrillConfig:
    rank: int = 0
    """Rank the faults are injected on."""
    group: int = 0
    """With replica groups (fault_tolerance.groups > 1): the group whose `rank` the drills
    target."""
    kill_group: int = -1
    """A replica group every process of which SIGKILLs itself at the steps of `kill_step`,
    inside the step (after backward, before the reduction across groups), once per run
    directory: a drill for fault-tolerant replica groups. -1: `kill_step` kills `rank` after
    the step instead."""
    nan_loss_step: list[int] = field(default_factory=list)
    """Steps at which the loss and every gradient of `rank` become NaN, after backward (as a NaN
    loss would leave them; a drill for the monitor)."""
    nan_grad_step: list[int] = field(default_factory=list)
    """Steps at which one gradient of `rank` gets a NaN after backward."""
    inf_grad_step: list[int] = field(default_factory=list)
    """Steps at which one gradient of `rank` gets an Inf after backward (an FP16 overflow drill)."""
    grad_spike_step: list[int] = field(default_factory=list)
    """Steps at which one gradient of `rank` (`grad_tensor`) is multiplied by `spike_factor`
    after backward, on the step's first execution only: silent data corruption (a replay comes
    out clean)."""
    data_spike_step: list[int] = field(default_factory=list)
    """As `grad_spike_step`, but the replay meets it again: a spike that belongs to the data
    (must never be called transient). Scaled after backward, it breaks the tensor's gradient
    checksum both times, which no batch can: the tensor is then no longer checksummed
    (monitor/checksums.py)."""
    bitflip_step: list[int] = field(default_factory=list)
    """Steps at which one bit of one value of `rank` flips, on the step's first execution only
    (silent data corruption): of the gradient `grad_tensor` after backward, or with
    `bitflip_activation` of the output of the module of that name in the first forward."""
    bitflip_bit: int = -1
    """The bit that flips, counted from the least significant of the value's dtype; -1: the
    highest exponent bit (30 in FP32, 14 in BF16 and FP16)."""
    bitflip_index: int = -1
    """The value whose bit flips (flat index into the tensor); -1: drawn from the step."""
    bitflip_activation: str = ""
    """A module name (e.g. `blocks.0.mlp`): flip a bit of its output instead of a gradient."""
    loss_spike_step: list[int] = field(default_factory=list)
    """Steps at which the loss `rank` reports is multiplied by `spike_factor` (gradients intact)."""
    spike_factor: float = 100.0
    """Factor of the spike drills."""
    spike_step: list[int] = field(default_factory=list)
    """Steps at which the loss and the gradients of `rank` are multiplied by `spike_factor`."""
    kill_step: list[int] = field(default_factory=list)
    """Steps at which `rank` SIGKILLs itself after the step (once per run directory, so that the
    restarted run does not repeat it): a drill for torchrun/SLURM restarts; with `kill_group`,
    every process of that group, inside the step."""
    sigterm_step: list[int] = field(default_factory=list)
    """Steps at which `rank` sends itself SIGTERM (a preemption drill)."""
    corrupt_checkpoint: bool = False
    """Flip bytes in the newest committed checkpoint before resuming (once per run directory): a
    drill for verified resume."""
    grad_tensor: str = ""
    """Canonical name of the gradient the grad drills poison (e.g. `blocks.0.mlp.fc.weight`);
    empty: the first one `rank` holds a part of."""
    transient_nan_step: list[int] = field(default_factory=list)
    """Steps at which one gradient of `rank` gets a NaN on the step's first execution only (a
    flaky-hardware drill: the replay comes out clean)."""
    router_bias: int = -1
    """An expert that `rank`'s routers favour at the steps of `router_bias_step`: its logit is
    raised by `router_bias_logit` in every MoE layer (a router-collapse drill; the step's
    replay meets it again). -1: off."""
    router_bias_step: list[int] = field(default_factory=list)
    """Steps of the router-bias drill."""
    router_bias_logit: float = 10.0
    """What the drill adds to the favoured expert's router logit."""
    hang_step: list[int] = field(default_factory=list)
    """Steps at which `rank` sleeps forever inside the step (a hang drill; once per run
    directory, so the restarted run goes on)."""
    slow_rank: int = -1
    """Rank that sleeps `slow_s` seconds in every step's forward+backward (a straggler drill;
    with replica groups, that rank of `group` only)."""
    slow_s: float = 0.0
    """Seconds `slow_rank` sleeps per step; 0: no straggler drill."""
    jitter_s: float = 0.0
    """With replica groups: every process of `group` sleeps a random time of up to this many
    seconds after each step, between its commit and the next step's quorum, where the
    lighthouse measures how late a group is (a noisy neighbour or a slow read; the draw comes
    from train.seed and the step, so the group's ranks sleep alike). 0: off."""
    diverge_group: int = -1
    """A replica group that changes one of its weights (the lowest bit of its first master value
    on rank 0) after step `diverge_step`, so that the groups hold different weights: a drill
    for the groups' comparison after a persistent checkpoint (the group takes a peer's state)
    and at the end (an error event and exit 7). -1: off."""
    diverge_step: list[int] = field(default_factory=list)
    """Steps after which `diverge_group` changes its weights; empty: its last step."""
    fp8_layer: str = ""
    """Canonical name of the FP8 layer the FP8 drills target (e.g. `blocks.0.mlp.up`); empty:
    the first FP8 layer."""
    fp8_amax_step: list[int] = field(default_factory=list)
    """Steps at which `fp8_layer` of `rank` casts its input to FP8 with the scale of an amax of
    `fp8_amax`, in the step's first run and its replay. Inf or NaN (a broken amax reduction): the
    layer's FP8 result turns non-finite from finite inputs. A finite amax below the inputs' (a
    stale one, as the inputs grow): the cast saturates, FP8 clips the inputs to its range."""
    fp8_amax: float = float("inf")
    """The amax of the fp8_amax drill: inf or nan, or a finite value below the inputs' amax."""
    fp8_outlier_from: int = -1
    """From this step on, `fp8_layer` of `rank` sees its first input channel times
    `fp8_outlier_factor` and that weight column divided by it (the same product exactly: an
    activation outlier absorbed by a small weight), which tensorwise FP8 scales by the outlier
    and so flushes the other inputs. -1: off."""
    fp8_outlier_factor: float = 1.0e6
    """Factor of the fp8_outlier drill."""


def check_drill_groups(f: DrillConfig, groups: int) -> None:
    """The drills' replica groups against fault_tolerance.groups (called by config/load.py's
    `validate`): a group that does not exist would never fire, and the drill would pass unseen."""
    if groups == 1 and f.group != 0:
        raise ConfigError(
            f"key 'drill.group' got {f.group}, but fault_tolerance.groups is 1 (no replica "
            "groups): use 0"
        )
    if not 0 <= f.group < groups:
        raise ConfigError(
            f"key 'drill.group' got {f.group}, expected a replica group 0..{groups - 1} "
            f"(fault_tolerance.groups is {groups})"
        )
    if groups == 1 and f.kill_group != -1:
        raise ConfigError(
            f"key 'drill.kill_group' got {f.kill_group}, but fault_tolerance.groups is 1 (no "
            "replica groups): use -1, and drill.kill_step alone to kill drill.rank"
        )
    if f.diverge_group != -1 and not 0 <= f.diverge_group < groups:
        raise ConfigError(
            f"key 'drill.diverge_group' got {f.diverge_group}, expected -1 (off) or a replica "
            f"group 0..{groups - 1} (fault_tolerance.groups is {groups})"
        )
    if f.kill_group != -1 and not 0 <= f.kill_group < groups:
        raise ConfigError(
            f"key 'drill.kill_group' got {f.kill_group}, expected -1 (off) or a replica group "
            f"0..{groups - 1} (fault_tolerance.groups is {groups})"
        )
