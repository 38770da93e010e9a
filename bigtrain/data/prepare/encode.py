"""Documents -> token ids with EOS after each, in batches and in order.

`data.num_proc=1` encodes in this process with the Rust tokenizer's own threads (it releases the
GIL and spreads a batch over every core). `data.num_proc=N>1` forks N worker processes that each
encode whole batches on one thread, while this process reads, parses and writes; at most 2N
batches are in flight, so memory stays bounded whatever the corpus's size. On the shared 2-core
VM of bench/prepare.py the two were within its noise of each other (docs/data.md).
Neither pickles a tokenizer nor fingerprints anything: workers rebuild it from its JSON once.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
from collections import deque
from collections.abc import Iterable, Iterator

import numpy as np

BATCH_DOCS = 1024
"""Documents per batch (fewer when BATCH_CHARS is reached first)."""
BATCH_CHARS = 4 << 20
"""Characters of text per batch (one longer document makes a batch of its own)."""


def batches(texts: Iterable[str]) -> Iterator[list[str]]:
    """Consecutive documents grouped into batches of at most BATCH_DOCS documents, and of
    BATCH_CHARS characters unless one document alone is longer."""
    batch: list[str] = []
    chars = 0
    for text in texts:
        if batch and (len(batch) == BATCH_DOCS or chars + len(text) > BATCH_CHARS):
            yield batch
            batch, chars = [], 0
        batch.append(text)
        chars += len(text)
    if batch:
        yield batch


class Encoder:
    """One batch of documents -> (tokens, lengths): every document's ids followed by EOS, as one
    array of `dtype`, and each document's length (EOS included) as uint64."""

    def __init__(self, tokenizer_json: str, eos_id: int, dtype: str) -> None:
        from tokenizers import Tokenizer

        self.tokenizer_json = tokenizer_json
        self.tokenizer = Tokenizer.from_str(tokenizer_json)
        # encode_batch_fast (newer tokenizers) skips the offsets that bigtrain does not use
        fast = getattr(self.tokenizer, "encode_batch_fast", None)
        self._encode = fast or self.tokenizer.encode_batch
        self.eos, self.dtype = (eos_id,), np.dtype(dtype)

    def __call__(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        ids = [e.ids for e in self._encode(texts, add_special_tokens=False)]
        lengths = np.fromiter(map(len, ids), np.uint64, len(ids)) + 1
        with_eos = itertools.chain.from_iterable(zip(ids, itertools.repeat(self.eos)))
        tokens = np.fromiter(
            itertools.chain.from_iterable(with_eos), self.dtype, int(lengths.sum())
        )
        return tokens, lengths


_worker_encoder: Encoder | None = None


def _start_worker(tokenizer_json: str, eos_id: int, dtype: str) -> None:
    global _worker_encoder
    _worker_encoder = Encoder(tokenizer_json, eos_id, dtype)


def _encode_in_worker(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    assert _worker_encoder is not None
    return _worker_encoder(texts)


def encode_batches(
    texts: Iterable[str], encoder: Encoder, num_proc: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(tokens, lengths) of each batch of `texts`, in order, with `num_proc` processes."""
    if num_proc <= 1:
        yield from map(encoder, batches(texts))
        return
    context = multiprocessing.get_context(
        "fork" if "fork" in multiprocessing.get_all_start_methods() else None
    )
    args = (encoder.tokenizer_json, encoder.eos[0], encoder.dtype.name)
    # Workers each encode on one thread: set before the fork, so that the tokenizers library
    # does not warn that a parent which used its threads was forked.
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        pool = context.Pool(num_proc, initializer=_start_worker, initargs=args)
    finally:
        if saved is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved
    with pool:  # terminates the workers, also when the consumer stops early
        pending: deque = deque()
        for batch in batches(texts):
            pending.append(pool.apply_async(_encode_in_worker, (batch,)))
            if len(pending) >= 2 * num_proc:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
