"""Straggler reports: every `monitor.timing_every` steps the ranks share the parts of their step
time (one small all-gather; StepTimer in train/timing.py measures them). A rank whose data,
forward+backward, optimizer or other part takes `monitor.straggler_factor` times the median of the
*other* ranks' part, at least MIN_SHARE of the step more (and MIN_EXCESS_S), on CONSECUTIVE timing
steps in a row, gets a `straggler` event naming the rank and the part, and again on every timing
step it stays one. A rank found on one timing step has the next step timed too, to confirm it
then rather than `monitor.timing_every` steps later. `sync` is reported, not judged: it is the
symptom on the ranks that wait.

Against the others, not a median that holds the rank itself: of 2 ranks that median is their
mean, so a rank had to take 1.86x the other's before it passed 1.3x; against the other rank it is
1.3x on 2 ranks as on 64. A rank's peers are the n - 1 others, and their median is a healthy
rank's time while at most half of all ranks are slow: one slow rank among 64 has 63 healthy peers,
and each of 32 slow ranks among 64 still has 32 healthy ones among its 63 (1 of 2 likewise). Past
half, slow is what a rank typically does and nobody is named.

The floor and the repeat are measured (bench/stragglers.py, docs/healing.md): on 2 busy CPU cores
a scheduler stall adds tens of milliseconds to a few-millisecond part (10 ms alone: 135-303 false
alarms per 1,000 healthy timing steps), and with 50-ms steps a healthy rank's part is still found
slow on 2% of timing steps, never on two in a row; a slow rank is slow on every step. 0 of 2,400
healthy timing steps named, every x1.5 and x2 drill run named."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence

from bigtrain.telemetry.memory import peak_memory_bytes
from bigtrain.train.hooks import Callback
from bigtrain.train.step import StepResult
from bigtrain.train.timing import PARTS
from bigtrain.utils.dist import all_gather_objects

JUDGED = ("data", "forward_backward", "optimizer", "other")
MIN_EXCESS_S = 0.01  # a straggler's part exceeds its peers' median by at least this much
MIN_SHARE = 0.2  # ... and by at least this share of the step (the members' median total)
CONSECUTIVE = 2  # timing steps in a row a (rank, part) is found on before it is named
PEAK = "peak_memory_bytes"
GROUP_PART = "work"  # a replica group's data and forward+backward, the part groups are judged on


def find_stragglers(
    by_member: Sequence[dict[str, float]],
    factor: float,
    min_excess_s: float = MIN_EXCESS_S,
    min_share: float = MIN_SHARE,
    parts: Iterable[str] = JUDGED,
) -> list[dict[str, float | int | str]]:
    """Members (ranks, or replica groups: any list of per-member seconds by part) whose part takes
    `factor` x the median of the *other* members' and exceeds it by `min_excess_s` and by
    `min_share` of the step (the median over members of the sum of all their parts, waiting
    included). Each: `member` (its index), `part`, `seconds`, `others_median_s`. A lone member
    has no peers: nobody is named."""
    if len(by_member) < 2:
        return []
    step_s = statistics.median(sum(times.values()) for times in by_member)
    floor_s = max(min_excess_s, min_share * step_s)
    found = []
    for part in parts:
        values = [times[part] for times in by_member]
        for member, value in enumerate(values):
            median = statistics.median(values[:member] + values[member + 1 :])
            if value > factor * median and value - median >= floor_s:
                found.append(
                    {"member": member, "part": part, "seconds": value, "others_median_s": median}
                )
    return found


class Streaks:
    """Which (member, part) pairs were found on `consecutive` timing steps in a row: named then,
    and on every timing step after while they stay found; a timing step without one ends its
    streak."""

    def __init__(self, consecutive: int) -> None:
        self.consecutive = consecutive
        self.counts: dict[tuple[int, str], int] = {}

    def update(self, found: Iterable[tuple[int, str]]) -> set[tuple[int, str]]:
        self.counts = {key: self.counts.get(key, 0) + 1 for key in set(found)}
        return {key for key, count in self.counts.items() if count >= self.consecutive}


class StragglerReport(Callback):
    """On timing steps: gathers every rank's parts into `result.step_time_by_rank` and its peak
    memory into `result.peak_memory_bytes_by_rank` (both logged), and writes `straggler`
    events. The streaks start again after a restart."""

    state_key = "stragglers"  # the groups' streaks: a rejoining group judges as the others

    def __init__(self, factor: float, consecutive: int = CONSECUTIVE) -> None:
        self.factor = factor
        self.streaks = Streaks(consecutive)
        self.group_streaks = Streaks(consecutive)

    def state_dict(self) -> dict:
        return {"groups": [[g, n] for (g, _), n in self.group_streaks.counts.items()]}

    def load_state_dict(self, state: dict) -> None:
        self.group_streaks.counts = {(g, GROUP_PART): n for g, n in state.get("groups", [])}

    def on_step_end(self, trainer, result: StepResult) -> None:
        timing = result.step_timing
        if timing is None:
            return
        # Each rank's peak memory travels in the same gather.
        gathered = all_gather_objects({**timing, PEAK: peak_memory_bytes(trainer.device)})
        by_rank = [{part: times[part] for part in PARTS} for times in gathered]
        result.step_time_by_rank = {
            part: [round(times[part], 6) for times in by_rank] for part in PARTS
        }
        result.peak_memory_bytes_by_rank = [times[PEAK] for times in gathered]
        self._groups(trainer, result)
        found = find_stragglers(by_rank, self.factor)
        named = self.streaks.update((s["member"], s["part"]) for s in found)
        if any((s["member"], s["part"]) not in named for s in found):
            trainer.timer.confirm()  # the next step says whether it is a straggler
        for straggler in found:
            if (straggler["member"], straggler["part"]) not in named:
                continue
            trainer.event(
                "straggler",
                rank=straggler["member"],
                part=straggler["part"],
                seconds=straggler["seconds"],
                others_median_s=straggler["others_median_s"],
                ratio=round(straggler["seconds"] / max(straggler["others_median_s"], 1e-9), 2),
                timing_steps=self.streaks.counts[straggler["member"], straggler["part"]],
            )

    def _groups(self, trainer, result: StepResult) -> None:
        """Replica groups: each group's own work (data and forward+backward, without the wait for
        the others) on its last timing step, as the step's reduction across the groups brought
        it (every group sees the same numbers and names the same group). A named group goes to
        `result.slow_groups` for the groups' policy (fault_tolerance.slow_group_leaves_after),
        and the leading group writes its `straggler` event."""
        times = trainer.replicas.group_times()
        # Groups judge on the steps every group times (a group's own confirming step is its own).
        if len(times) < 2 or result.step % trainer.timer.every != 0:
            return
        groups = sorted(times)
        members = [{GROUP_PART: times[g]} for g in groups]
        found = find_stragglers(members, self.factor, parts=(GROUP_PART,))
        named = self.group_streaks.update((groups[s["member"]], GROUP_PART) for s in found)
        result.slow_groups = {g: self.group_streaks.counts[g, part] for g, part in named}
        for straggler in found:
            group = groups[straggler["member"]]
            if (group, GROUP_PART) not in named or not trainer.replicas.leads:
                continue
            trainer.event(
                "straggler",
                group=group,
                scope="group",
                part=GROUP_PART,
                seconds=straggler["seconds"],
                others_median_s=straggler["others_median_s"],
                ratio=round(straggler["seconds"] / max(straggler["others_median_s"], 1e-9), 2),
                timing_steps=result.slow_groups[group],
            )
