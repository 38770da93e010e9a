"""Token shards as `bigtrain prepare` writes them (docs/data.md):

    shard_XXXXX.bin   raw little-endian tokens (uint16 or uint32), every document followed by EOS
    shard_XXXXX.idx   raw little-endian uint64: each document's end offset (exclusive, in tokens
                      within the shard)

Shards hold whole documents and close once they reach `shard_tokens`. A finished shard is
fsynced before it is recorded, so a record (with the files' sha256) always describes complete
files: that is what a resumed run keeps.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bigtrain.utils.files import fsync_dir
from bigtrain.utils.files import sha256_file as file_sha256

SHARD_FILE = re.compile(r"shard_(\d{5,})\.(bin|idx)")
INDEX_DTYPE = np.dtype("<u8")


def shard_files(number: int) -> tuple[str, str]:
    """The token file and index file names of shard `number`."""
    return f"shard_{number:05d}.bin", f"shard_{number:05d}.idx"


def intact_prefix(directory: Path, shards: list[dict], dtype: np.dtype) -> list[dict]:
    """The records of `shards`, in order, up to the first whose files are missing or differ from
    the record (size, then sha256): the shards a resumed run can keep."""
    kept = []
    for shard in shards:
        token_file, index_file = directory / shard["file"], directory / shard["index"]
        sizes = (
            shard["num_tokens"] * dtype.itemsize,
            shard["num_documents"] * INDEX_DTYPE.itemsize,
        )
        if not (token_file.is_file() and index_file.is_file()):
            break
        if (token_file.stat().st_size, index_file.stat().st_size) != sizes:
            break
        if (file_sha256(token_file), file_sha256(index_file)) != (
            shard["sha256"],
            shard["index_sha256"],
        ):
            break
        kept.append(shard)
    return kept


def remove_shards(directory: Path, keep: int) -> None:
    """Delete the files of every shard numbered `keep` or above (half-written ones included)."""
    for path in directory.iterdir():
        m = SHARD_FILE.fullmatch(path.name)
        if m and int(m.group(1)) >= keep:
            path.unlink()


class _OpenShard:
    """The shard being written: its two files and their running sha256."""

    def __init__(self, directory: Path, number: int, first_document: int, dtype: np.dtype):
        self.file, self.index = shard_files(number)
        self.first_document, self.dtype = first_document, dtype
        self.num_tokens = self.num_documents = 0
        self.max_token = -1  # the largest id written: recorded, so no open needs to read it
        self._files = [(directory / name).open("wb") for name in (self.file, self.index)]
        self._hashes = [hashlib.sha256(), hashlib.sha256()]

    def write(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append whole documents: their tokens, and their lengths (EOS included)."""
        ends = np.cumsum(lengths, dtype=INDEX_DTYPE) + self.num_tokens
        for f, h, data in zip(
            self._files, self._hashes, (tokens.astype(self.dtype, copy=False), ends), strict=True
        ):
            f.write(memoryview(data))
            h.update(memoryview(data))
        self.num_tokens += len(tokens)
        self.num_documents += len(lengths)
        if len(tokens):
            self.max_token = max(self.max_token, int(tokens.max()))

    def finish(self) -> dict:
        """Flush and fsync both files; the shard's record."""
        for f in self._files:
            f.flush()
            os.fsync(f.fileno())
            f.close()
        return {
            "file": self.file,
            "index": self.index,
            "num_tokens": self.num_tokens,
            "num_documents": self.num_documents,
            "first_document": self.first_document,
            "sha256": self._hashes[0].hexdigest(),
            "index_sha256": self._hashes[1].hexdigest(),
            "max_token": self.max_token,
        }

    def abandon(self) -> None:
        for f in self._files:
            f.close()


class ShardWriter:
    """Writes documents into shards of whole documents, each closed once it holds `shard_tokens`
    tokens or more; `on_finished(records)` runs after each shard is on disk (to record progress).
    `finished`: records of shards a previous run completed; numbering continues after them."""

    def __init__(
        self,
        directory: Path,
        dtype: str,
        shard_tokens: int,
        finished: list[dict],
        on_finished: Callable[[list[dict]], None],
    ) -> None:
        assert shard_tokens >= 1, shard_tokens
        self.directory, self.shard_tokens, self.on_finished = directory, shard_tokens, on_finished
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.shards = list(finished)
        self.current: _OpenShard | None = None

    @property
    def num_documents(self) -> int:
        """Documents in finished shards and in the current one."""
        done = sum(s["num_documents"] for s in self.shards)
        return done + (self.current.num_documents if self.current else 0)

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append a batch of documents (tokens with EOS after each, and their lengths)."""
        while len(lengths):
            if self.current is None:
                self.current = _OpenShard(
                    self.directory, len(self.shards), self.num_documents, self.dtype
                )
            room = self.shard_tokens - self.current.num_tokens
            ends = np.cumsum(lengths)
            # The documents up to the first one that fills the shard (or all of them).
            take = min(int(np.searchsorted(ends, room)) + 1, len(lengths))
            used = int(ends[take - 1])
            self.current.write(tokens[:used], lengths[:take])
            tokens, lengths = tokens[used:], lengths[take:]
            if self.current.num_tokens >= self.shard_tokens:
                self._finish()

    def close(self) -> list[dict]:
        """Finish the last shard; the records of all shards."""
        if self.current is not None:
            self._finish()
        return self.shards

    def abandon(self) -> None:
        """Close the current shard's files without recording it (on an error)."""
        if self.current is not None:
            self.current.abandon()
            self.current = None

    def _finish(self) -> None:
        assert self.current is not None
        self.shards.append(self.current.finish())
        self.current = None
        fsync_dir(self.directory)
        self.on_finished(self.shards)
