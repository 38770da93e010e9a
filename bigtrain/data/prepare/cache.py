"""The corpus a run trains on, tokenized once and cached: a prepared directory (the format of
`bigtrain prepare`, written by the same writer) under `data.cache_dir`, keyed by the corpus
fingerprint and the tokenizer:

    corpus-<key>/manifest.json, shard_XXXXX.bin/.idx, tokenizer/    (docs/data.md)

Entries are built in a temporary directory and renamed into place, so a crash never leaves a
half-written entry behind (the small-corpus path does not resume; `bigtrain prepare` does).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bigtrain.config.schema import DataConfig
from bigtrain.data.prepare.run import prepare
from bigtrain.data.prepare.summary import CorpusSummary
from bigtrain.data.prepare.tokenizer import EOS, load_tokenizer, tokenizer_key, train_bpe
from bigtrain.data.read.prepared import MANIFEST, PreparedData
from bigtrain.data.text.corpus import corpus_fingerprint, corpus_inputs, source_files
from bigtrain.utils.files import usual_permissions

__all__ = [
    "EOS",
    "TokenCorpus",
    "cache_entry",
    "cache_root",
    "load_tokenizer",
    "prepare_corpus",
    "train_bpe",
]

logger = logging.getLogger(__name__)

CACHE_VERSION = 2
"""Part of every cache key. 2: prepared directories (manifest.json and shards); entries of 1
(tokens.bin and meta.json) are not read, their corpora are tokenized again."""


def cache_root(cfg: DataConfig) -> Path:
    root = cfg.cache_dir or os.environ.get("BIGTRAIN_CACHE") or Path.home() / ".cache" / "bigtrain"
    return Path(root)


@dataclass
class TokenCorpus:
    """The packed corpus: a read-only token array plus what the model needs to know."""

    tokens: PreparedData | np.ndarray
    """The documents' tokens, EOS after each; sliced as `tokens[a:b]` (a numpy array)."""
    vocab_size: int
    eos_id: int
    tokenizer_dir: str
    key: str
    summary: CorpusSummary
    """Which corpus this is (logged at start, and in the `start` event)."""
    skipped_rows: dict[str, int] = field(default_factory=dict)
    """Resolved file path -> rows that data.skip_bad_rows left out when the cache entry was built
    (their text_key was missing, null or not a string); empty when none were."""

    def __len__(self) -> int:
        return len(self.tokens)


def cache_entry(cfg: DataConfig) -> Path:
    """The cache directory of this corpus and tokenizer (it may not exist yet)."""
    key = f"v{CACHE_VERSION}|{corpus_fingerprint(cfg)}|{tokenizer_key(cfg)}"
    return cache_root(cfg) / f"corpus-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def prepare_corpus(cfg: DataConfig) -> TokenCorpus:
    """Tokenize the corpus (or reuse the cache) and return its memory-mapped tokens."""
    entry = cache_entry(cfg)
    if not (entry / MANIFEST).is_file():
        logger.info("data: tokenizing the corpus into %s", entry)
        _build_entry(cfg, entry)
    data = PreparedData.open(entry)
    tokenizer_dir = str(data.tokenizer_dir)  # the entry's own copy, also of a named tokenizer
    skipped = data.manifest["skipped_rows"]
    if skipped:
        logger.warning(
            "data: %d rows without a string '%s' were skipped (data.skip_bad_rows): %s",
            sum(skipped.values()),
            cfg.text_key,
            ", ".join(f"{name} ({count})" for name, count in skipped.items()),
        )
    key = entry.name.removeprefix("corpus-")
    inputs = corpus_inputs(cfg, source_files(cfg))
    summary = CorpusSummary(cfg.source, inputs, data.num_documents, data.num_tokens)
    return TokenCorpus(data, data.vocab_size, data.eos_id, tokenizer_dir, key, summary, skipped)


def _build_entry(cfg: DataConfig, entry: Path) -> None:
    """Prepare into a temporary directory beside `entry` and rename it into place; on any error
    the temporary directory goes, so no partial entry is left behind."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=entry.name + ".tmp-", dir=entry.parent))
    try:
        prepare(cfg, tmp, shown_as=entry)
        usual_permissions(tmp)  # mkdtemp made it 0700: a cache others may share
        try:
            tmp.rename(entry)
        except OSError:  # another process built the same entry first: keep theirs
            if not (entry / MANIFEST).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
