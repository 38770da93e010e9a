"""Deterministic sample stream: which packed sequence each rank trains on, at every step.

The stream is a sequence of global positions 0, 1, 2, ... Position g maps to sample
`perm(seed, epoch)[g % n]` with epoch = g // n: a pure function of (seed, g), so any process can
compute any step's batch without replaying the ones before it. Skip windows are ranges of
positions [start, end) that are stepped over (bad data found by the rollback). Each optimizer step
consumes the next `global_batch` positions that are not skipped; rank r takes its contiguous
slice of them, split into micro-batches. The global batch is the same for every world size with
the same global batch size, which is what makes runs at different world sizes comparable.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from bigtrain.data.prepare.cache import TokenCorpus
from bigtrain.data.prepare.summary import CorpusSummary
from bigtrain.errors import ConfigError
from bigtrain.utils.seeds import derived_seed


class Samples(Protocol):
    """What BatchLoader and eval_batches read: (seq_len + 1)-token rows by sample id
    (PackedSamples; data/read/mixture.py's MixedSamples over several sources)."""

    def __len__(self) -> int: ...

    def get(self, indices: list[int]) -> torch.Tensor: ...


class PackedSamples:
    """Fixed-length samples of seq_len + 1 tokens (inputs and shifted targets) over a token range.
    Consecutive samples overlap by one token so that every token is a target exactly once.
    `tokens` is a numpy array or anything that slices like one (data/read/prepared.py)."""

    def __init__(self, tokens: Any, seq_len: int, first: int, count: int) -> None:
        self.tokens, self.seq_len, self.first, self.count = tokens, seq_len, first, count

    def __len__(self) -> int:
        return self.count

    def get(self, indices: list[int]) -> torch.Tensor:
        """(len(indices), seq_len + 1) int64 tensor."""
        rows = [
            self.tokens[(self.first + i) * self.seq_len : (self.first + i + 1) * self.seq_len + 1]
            for i in indices
        ]
        return torch.from_numpy(np.stack(rows).astype(np.int64))


def split_samples(
    corpus: TokenCorpus, seq_len: int, val_fraction: float
) -> tuple[PackedSamples, PackedSamples]:
    """Train on the head of the token stream, validate on its tail (no sequence crosses over)."""
    return split_tokens(corpus.tokens, seq_len, val_fraction, "the corpus")


def split_tokens(
    tokens: Any, seq_len: int, val_fraction: float, what: str
) -> tuple[PackedSamples, PackedSamples]:
    """split_samples of any token array that slices like a numpy one (a prepared directory's
    PreparedData too); `what` names it in the error."""
    total = (len(tokens) - 1) // seq_len
    n_val = max(1, int(round(total * val_fraction)))
    n_train = total - n_val
    if n_train < 1:
        raise ConfigError(
            f"data: {what} has {len(tokens)} tokens, too few for model.seq_len={seq_len} "
            f"and data.val_fraction={val_fraction} (need at least 2 sequences)"
        )
    return PackedSamples(tokens, seq_len, 0, n_train), PackedSamples(
        tokens, seq_len, n_train, n_val
    )


@dataclass
class TrainingData:
    """What a run reads, whatever its source: the training samples in the stream's order, the
    validation samples, and what the model and the run must know of the corpus. The token cache
    of data.source=shakespeare/files/hub is one source (`from_corpus`); data.mixture's prepared
    directories are mixed (data/read/sources.py). Both read prepared directories through
    data/read/prepared.py."""

    key: str
    """Identity of the training data (resume refuses another without allow_config_change)."""
    summary: CorpusSummary
    """Which corpus this is (logged at start, and in the `start` event)."""
    vocab_size: int
    eos_id: int
    tokenizer_dir: str
    train: Samples
    stream: SampleStream
    val: Samples
    skipped_rows: dict[str, int] = field(default_factory=dict)
    """Rows left out when the data was prepared (data.skip_bad_rows), by file."""


def from_corpus(corpus: TokenCorpus, seq_len: int, val_fraction: float, seed: int) -> TrainingData:
    """One corpus: train on the head of its tokens in the seed's order, validate on the tail."""
    train, val = split_samples(corpus, seq_len, val_fraction)
    return TrainingData(
        corpus.key,
        corpus.summary,
        corpus.vocab_size,
        corpus.eos_id,
        corpus.tokenizer_dir,
        train,
        SampleStream(len(train), seed),
        val,
        corpus.skipped_rows,
    )


CANNOT_CONTINUE = (
    "the data order cannot continue, not even with checkpoint.allow_config_change=true"
)
NEW_RUN = "start another train.out_dir (model.init_from takes the checkpoint's weights)"


def _epoch_seed(seed: int, epoch: int) -> int:
    return derived_seed("bigtrain-order", seed, epoch)


class SampleStream:
    """Positions -> sample ids, with a cursor and skip windows. State is (cursor, skip windows)."""

    def __init__(self, num_samples: int, seed: int) -> None:
        self.num_samples, self.seed = num_samples, seed
        self.cursor = 0
        self.skip_windows: list[tuple[int, int]] = []
        self.end: int | None = None  # positions the stream holds; None: endless
        self._perm: tuple[int, np.ndarray] | None = None

    def sample_at(self, position: int) -> int:
        epoch, offset = divmod(position, self.num_samples)
        if self._perm is None or self._perm[0] != epoch:
            g = torch.Generator().manual_seed(_epoch_seed(self.seed, epoch))
            self._perm = (epoch, torch.randperm(self.num_samples, generator=g).numpy())
        return int(self._perm[1][offset])

    def add_skip_window(self, start: int, end: int) -> None:
        """Never train on positions [start, end) again (merged with overlapping windows)."""
        assert 0 <= start < end, (start, end)
        windows = sorted([*self.skip_windows, (start, end)])
        merged: list[tuple[int, int]] = []
        for s, e in windows:
            if merged and s <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], e))
            else:
                merged.append((s, e))
        self.skip_windows = merged

    def take(self, count: int) -> list[int]:
        """The next `count` positions that are not skipped; advances the cursor past them."""
        positions, self.cursor = self.positions_from(self.cursor, count)
        return positions

    def positions_from(self, cursor: int, count: int) -> tuple[list[int], int]:
        """`count` positions not skipped from `cursor` on, and the cursor after them (pure)."""
        positions = []
        g = cursor
        while len(positions) < count:
            for s, e in self.skip_windows:
                if s <= g < e:
                    g = e
            positions.append(g)
            g += 1
        return positions, g

    def state_dict(self) -> dict[str, Any]:
        return {
            "cursor": self.cursor,
            "skip_windows": [list(w) for w in self.skip_windows],
            "seed": self.seed,
            "num_samples": self.num_samples,
        }

    def check_state(self, state: dict[str, Any]) -> None:
        """ConfigError unless a checkpoint's stream `state` continues in this stream: the same
        order of samples. Resume asks before anything else about the checkpoint (resume.py), as
        checkpoint.allow_config_change cannot change this."""
        if "mixture" in state:
            raise ConfigError(
                "data: the checkpoint was trained on data.mixture (data.source=prepared), this "
                f"run on one corpus: {CANNOT_CONTINUE}; {NEW_RUN}"
            )
        if state["num_samples"] != self.num_samples or state["seed"] != self.seed:
            raise ConfigError(
                f"data: the checkpoint's sample order (seed {state['seed']}, "
                f"{state['num_samples']} samples) differs from this run's (seed {self.seed}, "
                f"{self.num_samples} samples): train.seed or the corpus changed, and "
                f"{CANNOT_CONTINUE}; keep both, or {NEW_RUN}"
            )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)
        self.cursor = int(state["cursor"])
        self.skip_windows = [(int(s), int(e)) for s, e in state["skip_windows"]]


class BatchLoader:
    """This rank's micro-batches for each optimizer step, as (inputs, targets) int64 tensors.

    With `prefetch` > 0 a background thread reads the next steps' rows (into pinned memory with
    `pin_memory`) while the current step computes. What it read is keyed by stream positions: the
    loop gets it only if the stream, as it is now (after a rollback, a resume or a skip window),
    asks for exactly those positions; otherwise it reads them itself."""

    def __init__(
        self,
        samples: Samples,
        stream: SampleStream,
        micro_batch_size: int,
        grad_accum_steps: int,
        rank: int,
        world_size: int,
        device: torch.device,
        prefetch: int = 0,
        pin_memory: bool = False,
    ) -> None:
        self.samples, self.stream = samples, stream
        self.micro, self.accum, self.rank, self.world, self.device = (
            micro_batch_size,
            grad_accum_steps,
            rank,
            world_size,
            device,
        )
        self.prefetch, self.pin_memory = prefetch, pin_memory
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="bigtrain-data") if prefetch else None
        self._ahead: dict[tuple[int, ...], Future] = {}
        self.prefetch_hits = 0  # steps served from the read-ahead (tests, telemetry)

    @property
    def global_batch_size(self) -> int:
        return self.micro * self.accum * self.world

    def rank_positions(self, global_positions: list[int]) -> list[int]:
        per_rank = self.micro * self.accum
        return global_positions[self.rank * per_rank : (self.rank + 1) * per_rank]

    def _read(self, ids: list[int]) -> list[torch.Tensor]:
        """Host rows of each micro-batch (runs in the read-ahead thread)."""
        rows = [
            self.samples.get(ids[m * self.micro : (m + 1) * self.micro]) for m in range(self.accum)
        ]
        return [r.pin_memory() for r in rows] if self.pin_memory else rows

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        positions = self.rank_positions(self.stream.take(self.global_batch_size))
        ahead = self._ahead.pop(tuple(positions), None)
        if ahead is not None:
            rows = ahead.result()
            self.prefetch_hits += 1
        else:
            rows = self._read([self.stream.sample_at(p) for p in positions])
        if self._pool is not None:
            self._read_ahead()
        batches = []
        for r in rows:
            r = r.to(self.device, non_blocking=True)  # asynchronous from pinned memory
            batches.append((r[:, :-1], r[:, 1:]))
        return batches

    def _read_ahead(self) -> None:
        """Queue the next `prefetch` steps of the stream as it stands; drop stale reads."""
        assert self._pool is not None
        wanted, cursor = [], self.stream.cursor
        end = self.stream.end
        for _ in range(self.prefetch):
            global_positions, cursor = self.stream.positions_from(cursor, self.global_batch_size)
            if end is not None and global_positions[-1] >= end:
                break  # the stream ends there: a step that needs more raises in take()
            wanted.append(tuple(self.rank_positions(global_positions)))
        self._ahead = {k: v for k, v in self._ahead.items() if k in wanted}
        for key in wanted:
            if key not in self._ahead:
                # Sample ids are looked up here: the permutation cache is not thread-safe.
                ids = [self.stream.sample_at(p) for p in key]
                self._ahead[key] = self._pool.submit(self._read, ids)


def eval_batches(
    samples: Samples,
    micro_batch_size: int,
    num_batches: int,
    rank: int,
    world_size: int,
    device: torch.device,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same validation sequences at every evaluation; ranks split them, wrapping if short."""
    total = micro_batch_size * num_batches * world_size
    ids = [i % len(samples) for i in range(total)]
    mine = ids[rank * micro_batch_size * num_batches : (rank + 1) * micro_batch_size * num_batches]
    out = []
    for b in range(num_batches):
        rows = samples.get(mine[b * micro_batch_size : (b + 1) * micro_batch_size]).to(device)
        out.append((rows[:, :-1], rows[:, 1:]))
    return out
