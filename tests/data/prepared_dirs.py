"""Prepared directories (the `bigtrain prepare` format, bigtrain-prepared-1) written from numpy
token arrays, for tests of the reader and of mixtures without running `bigtrain prepare`."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np


def tokenizer_sha256(tokenizer_dir: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(tokenizer_dir.iterdir()):
        if f.is_file():
            h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


def fake_tokenizer(path: Path, tag: str = "a") -> Path:
    """A directory that stands for a tokenizer where nothing loads it: without a tokenizer.json,
    its files' sha256 is its identity."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "vocab.json").write_text(json.dumps({"tag": tag}))
    return path


def write_prepared(
    path: Path,
    documents: list[np.ndarray],
    tokenizer_dir: Path,
    eos_id: int = 0,
    vocab_size: int = 256,
    shard_tokens: int = 1000,
    dtype: str = "uint16",
) -> Path:
    """DIR with manifest.json, shard_XXXXX.bin/.idx (a new shard once one holds `shard_tokens`
    or more) and tokenizer/ (a copy of `tokenizer_dir`); every document is followed by EOS."""
    path.mkdir(parents=True)
    shutil.copytree(tokenizer_dir, path / "tokenizer")
    shards: list[list[np.ndarray]] = [[]]
    for doc in documents:
        if sum(len(d) for d in shards[-1]) >= shard_tokens:
            shards.append([])
        shards[-1].append(np.append(np.asarray(doc), eos_id).astype(dtype))
    entries, first_document = [], 0
    for i, docs in enumerate(shards):
        tokens = np.concatenate(docs).astype(np.dtype(dtype).newbyteorder("<"))
        ends = np.cumsum([len(d) for d in docs]).astype("<u8")
        name = f"shard_{i:05d}"
        (path / f"{name}.bin").write_bytes(tokens.tobytes())
        (path / f"{name}.idx").write_bytes(ends.tobytes())
        entries.append(
            {
                "file": f"{name}.bin",
                "index": f"{name}.idx",
                "num_tokens": len(tokens),
                "num_documents": len(docs),
                "first_document": first_document,
                "sha256": hashlib.sha256(tokens.tobytes()).hexdigest(),
                "index_sha256": hashlib.sha256(ends.tobytes()).hexdigest(),
            }
        )
        first_document += len(docs)
    manifest = {
        "format": "bigtrain-prepared-1",
        "bigtrain_version": "test",
        "dtype": dtype,
        "num_tokens": sum(e["num_tokens"] for e in entries),
        "num_documents": first_document,
        "eos_id": eos_id,
        "vocab_size": vocab_size,
        "tokenizer": {"dir": "tokenizer", "sha256": tokenizer_sha256(path / "tokenizer")},
        "source": {"test": str(path)},
        "skipped_rows": {},
        "shards": entries,
    }
    (path / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return path


def random_documents(
    seed: int, num_tokens: int, vocab_size: int = 256, low: int = 1
) -> list[np.ndarray]:
    """Documents of 5..60 random ids in [low, vocab_size), about num_tokens in all."""
    rng = np.random.default_rng(seed)
    docs, total = [], 0
    while total < num_tokens:
        doc = rng.integers(low, vocab_size, size=int(rng.integers(5, 60)))
        docs.append(doc)
        total += len(doc) + 1
    return docs
