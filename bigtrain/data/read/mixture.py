"""Weighted mixtures: which source, and which of its samples, each global position holds.

Positions are cut into blocks of `block_size` (1024, larger only for weights more than 1024 to 1
apart). The sources' cumulative draws after j blocks are the largest-remainder apportionment of
j x block_size by their (exact, integer-scaled) weights, so every source stays within one sample
of its share at every block boundary and a block's counts are the difference of two of them. A
block's source assignment is shuffled by a generator seeded from (seed, block). A source's k-th
draw is sample perm(seed_s, k // n_s)[k % n_s]: a new order each epoch, as in SampleStream.

`max_epochs` ends a source's draws at floor(max_epochs x n_s): in the block where it gets there
(its last), the draws it no longer takes go to the others by their weights, and from the next
block on the others share its weight. That cuts the order into at most one phase per source,
each of constant weights, computed once; so position -> sample is a pure function of (seed,
mixture, position), O(1) amortised, at any position, without replaying the ones before it.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import Any

import numpy as np
import torch

from bigtrain.data.read.stream import CANNOT_CONTINUE, NEW_RUN, SampleStream
from bigtrain.errors import ConfigError
from bigtrain.utils.seeds import derived_seed

BLOCK_SIZE = 1024
MAX_BLOCK_SIZE = 1 << 20


@dataclass(frozen=True)
class SourceSpec:
    """What the order of a mixture depends on, per source (its state_dict records these)."""

    name: str
    num_samples: int
    weight: float
    max_epochs: float | None = None

    @property
    def cap(self) -> int | None:
        """Draws allowed before the source is exhausted (exact: no float rounding)."""
        if self.max_epochs is None:
            return None
        return math.floor(Fraction(self.max_epochs) * self.num_samples)


def apportion(total: int, weights: list[int]) -> list[int]:
    """`total` split in proportion to integer `weights`: floors, then one more each for the
    largest remainders (ties to the lower index). Zero weights get nothing."""
    weight_sum = sum(weights)
    counts, remainders = [], []
    for w in weights:
        q, r = divmod(total * w, weight_sum)
        counts.append(q)
        remainders.append(r)
    left = total - sum(counts)
    for i in sorted(range(len(weights)), key=lambda i: (-remainders[i], i))[:left]:
        counts[i] += 1
    return counts


def integer_weights(weights: list[float]) -> list[int]:
    """The weights scaled exactly to integers (floats are dyadic fractions)."""
    fractions = [Fraction(w) for w in weights]
    scale = math.lcm(*(f.denominator for f in fractions))
    return [int(f * scale) for f in fractions]


@dataclass
class _Phase:
    """Blocks first_block .. last_block (None: for ever) of constant weights; the last one is
    where some source reaches its cap, with `last_counts` instead of the apportionment."""

    first_block: int
    base: list[int]  # draws per source before first_block
    weights: list[int]  # 0 for the sources exhausted before this phase
    last_block: int | None = None
    last_counts: list[int] | None = None

    def drawn(self, j: int, block_size: int) -> list[int]:
        """Draws per source in this phase's first j blocks (not past the last block)."""
        return apportion(j * block_size, self.weights)


def _block_seed(seed: int, block: int) -> int:
    return derived_seed("bigtrain-mixture", seed, block)


def _source_seed(seed: int, index: int) -> int:
    return derived_seed("bigtrain-mixture-source", seed, index)


@dataclass
class _Block:
    sources: np.ndarray  # source of each offset
    rank: np.ndarray  # index of each offset's draw among its source's draws in the block
    before: list[int]  # draws per source before the block


class MixtureOrder:
    """Position -> (source, draw index of that source); the phases; where each source ends."""

    def __init__(self, specs: list[SourceSpec], seed: int) -> None:
        self.specs, self.seed = specs, seed
        weights = integer_weights([s.weight for s in specs])
        self.block_size = BLOCK_SIZE
        while self.block_size * min(weights) < sum(weights):  # every source in every block
            self.block_size *= 2
        if self.block_size > MAX_BLOCK_SIZE:
            raise ConfigError(
                f"data.mixture: weights {[s.weight for s in specs]} are more than "
                f"{MAX_BLOCK_SIZE} to 1 apart; raise the smallest"
            )
        for s in specs:
            if s.cap == 0:
                raise ConfigError(
                    f"data.mixture: source '{s.name}' has {s.num_samples} samples; max_epochs="
                    f"{s.max_epochs} of them is less than one sample"
                )
        self._cache: OrderedDict[int, _Block] = OrderedDict()  # the newest blocks' assignments
        self.phases = self._phases(weights)
        self.end: int | None = None  # positions in all, when every source has a cap
        last = self.phases[-1]
        if last.last_block is not None:  # every source ran out in that block
            assert last.last_counts is not None
            self.end = last.last_block * self.block_size + sum(last.last_counts)
        self.exhausted_at = self._exhaustion_positions()

    def _phases(self, weights: list[int]) -> list[_Phase]:
        phases = [_Phase(0, [0] * len(weights), weights)]
        while True:
            phase = phases[-1]
            last = self._last_block_of(phase)
            if last is None:
                return phases
            before = [
                b + d for b, d in zip(phase.base, phase.drawn(last, self.block_size), strict=True)
            ]
            counts, exhausted = self._final_counts(phase, last, before)
            phase.last_block, phase.last_counts = phase.first_block + last, counts
            after = [b + c for b, c in zip(before, counts, strict=True)]
            left = [0 if s in exhausted or w == 0 else w for s, w in enumerate(phase.weights)]
            if not any(left):
                return phases
            phases.append(_Phase(phase.first_block + last + 1, after, left))

    def _last_block_of(self, phase: _Phase) -> int | None:
        """The phase's first block (counted from its start) in which a source reaches its cap."""
        found = None
        for s, spec in enumerate(self.specs):
            cap, w = spec.cap, phase.weights[s]
            if cap is None or w == 0:
                continue
            need = cap - phase.base[s]
            # draws after j blocks are within one of j * size * w / W: search below an upper bound
            lo, hi = 0, need * sum(phase.weights) // (self.block_size * w) + 2
            assert phase.drawn(hi + 1, self.block_size)[s] >= need
            while lo < hi:
                mid = (lo + hi) // 2
                if phase.drawn(mid + 1, self.block_size)[s] >= need:
                    hi = mid
                else:
                    lo = mid + 1
            found = lo if found is None else min(found, lo)
        return found

    def _final_counts(self, phase: _Phase, j: int, before: list[int]) -> tuple[list[int], set[int]]:
        """Counts of a phase's last block: each source that reaches its cap takes only what it
        has left; what it leaves goes to the others by weight (again capped). The block is short
        only when every source ran out in it."""
        size = self.block_size
        counts = [
            a - b for a, b in zip(phase.drawn(j + 1, size), phase.drawn(j, size), strict=True)
        ]
        exhausted: set[int] = set()
        while True:
            for s, spec in enumerate(self.specs):
                cap = spec.cap
                if cap is not None and phase.weights[s] and before[s] + counts[s] >= cap:
                    counts[s] = cap - before[s]
                    exhausted.add(s)
            left = size - sum(counts)
            open_weights = [0 if s in exhausted else w for s, w in enumerate(phase.weights)]
            if left == 0 or not any(open_weights):
                return counts, exhausted
            counts = [
                c + extra for c, extra in zip(counts, apportion(left, open_weights), strict=True)
            ]

    def _exhaustion_positions(self) -> dict[int, int]:
        """Source index -> the position after its last draw, for the sources that run out."""
        out: dict[int, int] = {}
        for phase in self.phases:
            if phase.last_block is None:
                continue
            block = self.block(phase.last_block)
            start = phase.last_block * self.block_size
            for s, spec in enumerate(self.specs):
                cap = spec.cap
                if s in out or cap is None or block.before[s] >= cap:
                    continue
                if block.before[s] + int(np.sum(block.sources == s)) >= cap:
                    out[s] = start + int(np.flatnonzero(block.sources == s)[-1]) + 1
        return out

    def _phase_of(self, block: int) -> _Phase:
        for phase in self.phases:
            if phase.last_block is None or block <= phase.last_block:
                return phase
        raise AssertionError("a block past the end of the mixture")

    def counts(self, block: int) -> tuple[list[int], list[int]]:
        """(draws per source before the block, draws per source in it)."""
        phase = self._phase_of(block)
        j, size = block - phase.first_block, self.block_size
        drawn = phase.drawn(j, size)
        before = [b + d for b, d in zip(phase.base, drawn, strict=True)]
        if block == phase.last_block:
            assert phase.last_counts is not None
            return before, list(phase.last_counts)
        return before, [a - d for a, d in zip(phase.drawn(j + 1, size), drawn, strict=True)]

    def block(self, index: int) -> _Block:
        cached = self._cache.get(index)
        if cached is not None:
            self._cache.move_to_end(index)
            return cached
        before, counts = self.counts(index)
        sources = np.repeat(np.arange(len(self.specs), dtype=np.int64), counts)
        g = torch.Generator().manual_seed(_block_seed(self.seed, index))
        sources = sources[torch.randperm(len(sources), generator=g).numpy()]
        rank = np.zeros(len(sources), dtype=np.int64)
        for s in range(len(self.specs)):
            where = np.flatnonzero(sources == s)
            rank[where] = np.arange(len(where))
        self._cache[index] = _Block(sources, rank, before)
        if len(self._cache) > 8:
            self._cache.popitem(last=False)
        return self._cache[index]

    def draws_before(self, position: int) -> list[int]:
        """Draws per source at positions [0, position)."""
        if self.end is not None and position >= self.end:
            return [s.cap or 0 for s in self.specs]
        index, offset = divmod(position, self.block_size)
        block = self.block(index)
        within = np.bincount(block.sources[:offset], minlength=len(self.specs))
        return [b + int(w) for b, w in zip(block.before, within, strict=True)]

    def locate(self, position: int) -> tuple[int, int]:
        """(source index, index of this draw among the source's draws) at `position`."""
        index, offset = divmod(position, self.block_size)
        block = self.block(index)
        source = int(block.sources[offset])
        return source, block.before[source] + int(block.rank[offset])


class MixtureStream(SampleStream):
    """SampleStream's interface (cursor, skip windows, take, state) over a mixture: global
    sample ids are the sources' samples one after the other (MixedSamples reads them)."""

    def __init__(self, specs: list[SourceSpec], seed: int) -> None:
        super().__init__(sum(s.num_samples for s in specs), seed)
        self.specs = specs
        self.order = MixtureOrder(specs, seed)
        self.end = self.order.end
        self.offsets = [0, *np.cumsum([s.num_samples for s in specs]).tolist()]
        # each source's own epochs, with an order of its own
        self._epochs = [
            SampleStream(s.num_samples, _source_seed(seed, i)) for i, s in enumerate(specs)
        ]

    def sample_at(self, position: int) -> int:
        if self.end is not None and position >= self.end:
            raise ConfigError(self._ran_out(position))
        source, draw = self.order.locate(position)
        return self.offsets[source] + self._epochs[source].sample_at(draw)

    def take(self, count: int) -> list[int]:
        positions, cursor = self.positions_from(self.cursor, count)
        if self.end is not None and positions[-1] >= self.end:
            raise ConfigError(self._ran_out(positions[-1]))
        self.cursor = cursor
        return positions

    def _ran_out(self, position: int) -> str:
        limits = ", ".join(f"{s.name} max_epochs={s.max_epochs}" for s in self.specs)
        return (
            f"data.mixture: every source is exhausted ({limits}) after {self.end} samples, but "
            f"the run needs sample position {position}; raise max_epochs, add a source without "
            "it, or lower train.max_steps"
        )

    def samples_by_source(self) -> dict[str, int]:
        """Samples trained on per source name: the positions before the cursor that no skip
        window holds (a pure function of the cursor and the skip windows)."""
        draws = self.order.draws_before
        taken = np.array(draws(self.cursor), dtype=np.int64)
        for start, end in self.skip_windows:
            if start < self.cursor:
                taken -= np.array(draws(min(end, self.cursor))) - np.array(draws(start))
        return {s.name: int(n) for s, n in zip(self.specs, taken, strict=True)}

    def exhaustions(self) -> list[tuple[SourceSpec, int]]:
        """(source, position after its last draw) of the sources that run out, by position."""
        found = [(self.specs[s], p) for s, p in self.order.exhausted_at.items()]
        return sorted(found, key=lambda item: item[1])

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "mixture": [asdict(s) for s in self.specs],
            "block_size": self.order.block_size,
        }

    def check_state(self, state: dict[str, Any]) -> None:
        saved = state.get("mixture")
        if saved is None:
            raise ConfigError(
                "data: the checkpoint was trained on one corpus, this run on data.mixture: "
                f"{CANNOT_CONTINUE}; {NEW_RUN}"
            )
        mine = [asdict(s) for s in self.specs]
        if saved != mine or state["seed"] != self.seed:
            raise ConfigError(
                f"data: the checkpoint's mixture (seed {state['seed']}: {_describe(saved)}) "
                f"differs from this run's (seed {self.seed}: {_describe(mine)}): "
                f"{CANNOT_CONTINUE}; keep data.mixture and train.seed, or {NEW_RUN}"
            )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)
        assert state["block_size"] == self.order.block_size  # a function of the weights
        self.cursor = int(state["cursor"])
        self.skip_windows = [(int(s), int(e)) for s, e in state["skip_windows"]]


def _describe(specs: list[dict[str, Any]]) -> str:
    return ", ".join(
        f"{s['name']} x{s['weight']} ({s['num_samples']} samples, max_epochs {s['max_epochs']})"
        for s in specs
    )


class MixedSamples:
    """PackedSamples' `get` over several sources: global id i is sample i - offsets[s] of the
    source s whose range holds it."""

    def __init__(self, parts: list, names: list[str]) -> None:
        self.parts, self.names = parts, names
        self.offsets = np.cumsum([0, *(len(p) for p in parts)])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def source_of(self, sample_id: int) -> tuple[int, int]:
        """(source index, local sample id) of a global sample id."""
        source = int(np.searchsorted(self.offsets, sample_id, side="right")) - 1
        return source, sample_id - int(self.offsets[source])

    def get(self, indices: list[int]) -> torch.Tensor:
        """(len(indices), seq_len + 1) int64 tensor, rows in the order asked."""
        located = [self.source_of(i) for i in indices]
        rows: list[torch.Tensor | None] = [None] * len(indices)
        for source, part in enumerate(self.parts):
            mine = [k for k, (s, _) in enumerate(located) if s == source]
            if mine:
                got = part.get([located[k][1] for k in mine])
                for k, row in zip(mine, got, strict=True):
                    rows[k] = row
        return torch.stack(rows)  # type: ignore[arg-type]
