"""A directory that `bigtrain prepare` wrote, read as one token array over memory-mapped shards.

    data = PreparedData.open("corpus/")     # checks the manifest, sizes and sha256
    data[1000:3000]                         # numpy array of tokens, across shard boundaries

Verifying every shard's sha256 at every open would take minutes on a large corpus, so a verified
file is stamped in DIR/.verified.json (its size, mtime, ctime, inode and sha256; for a token file
also its largest id): a later open hashes only the files that changed since. Every open with
`verify` checks each token file's largest id against the vocabulary (the manifest's vocab_size):
an id beyond it would index past the model's embedding. `verify=False` checks sizes only.
"""

from __future__ import annotations

import contextlib
import functools
import json
import operator
from pathlib import Path

import numpy as np

from bigtrain.data.prepare.shards import INDEX_DTYPE
from bigtrain.data.prepare.tokenizer import tokenizer_identity, tokenizer_sha256
from bigtrain.errors import ConfigError
from bigtrain.utils.files import sha256_file as file_sha256
from bigtrain.utils.files import write_json_atomic

FORMAT = "bigtrain-prepared-1"
MANIFEST = "manifest.json"
TOKENIZER = "tokenizer"
STAMP = ".verified.json"
DTYPES = ("uint16", "uint32")


class PreparedData:
    """The tokens of a prepared directory: `len()` tokens, sliced like a 1-D numpy array (each
    shard is an np.memmap, opened on first use and kept)."""

    def __init__(self, path: Path, manifest: dict) -> None:
        self.path = path
        self.manifest = manifest
        self.dtype = np.dtype(manifest["dtype"]).newbyteorder("<")
        self.num_tokens: int = manifest["num_tokens"]
        self.num_documents: int = manifest["num_documents"]
        self.eos_id: int = manifest["eos_id"]
        self.vocab_size: int = manifest["vocab_size"]
        self.tokenizer_dir = path / manifest["tokenizer"]["dir"]
        self.tokenizer_sha256: str = manifest["tokenizer"]["sha256"]
        self.shards: list[dict] = manifest["shards"]
        counts = [s["num_tokens"] for s in self.shards]
        self._starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        self._maps: dict[int, np.ndarray] = {}

    @classmethod
    def open(cls, path: str | Path, verify: bool = True) -> PreparedData:
        """Open a prepared directory; ConfigError naming the directory or file if it is not one,
        is incomplete, or a file has the wrong size (or, with `verify`, the wrong sha256)."""
        path = Path(path)
        data = cls(path, _read_manifest(path))
        data._check_sizes()
        if verify:
            _verify(data)
        return data

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def shape(self) -> tuple[int]:
        return (self.num_tokens,)

    def __len__(self) -> int:
        return self.num_tokens

    def __getitem__(self, index: slice | int) -> np.ndarray:
        if isinstance(index, slice):
            start, stop, step = index.indices(self.num_tokens)
            if step < 0:  # rare: read everything
                return self._range(0, self.num_tokens)[index]
            tokens = self._range(start, max(start, stop))
            return tokens if step == 1 else tokens[::step]
        i = operator.index(index)
        if not -self.num_tokens <= i < self.num_tokens:
            raise IndexError(f"token {index} of {self.num_tokens}")
        i %= self.num_tokens
        shard = int(np.searchsorted(self._starts, i, side="right")) - 1
        return self._shard(shard)[i - self._starts[shard]]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        tokens = self[:]
        return tokens if dtype is None else tokens.astype(dtype)

    def document_ends(self) -> np.ndarray:
        """The end offset (exclusive) of every document in the whole token array, uint64."""
        parts = []
        for number, shard in enumerate(self.shards):
            ends = np.fromfile(self.path / shard["index"], dtype=INDEX_DTYPE)
            parts.append(ends + np.uint64(self._starts[number]))
        return np.concatenate(parts).astype(np.uint64)

    def _range(self, start: int, stop: int) -> np.ndarray:
        parts = []
        shard = int(np.searchsorted(self._starts, start, side="right")) - 1
        while start < stop:
            base, end = int(self._starts[shard]), int(self._starts[shard + 1])
            parts.append(self._shard(shard)[start - base : min(stop, end) - base])
            start, shard = min(stop, end), shard + 1
        if not parts:
            return np.empty(0, self.dtype)
        return np.asarray(parts[0]) if len(parts) == 1 else np.concatenate(parts)

    def _shard(self, number: int) -> np.ndarray:
        tokens = self._maps.get(number)
        if tokens is None:
            shard = self.shards[number]
            tokens = np.memmap(
                self.path / shard["file"], self.dtype, mode="r", shape=(shard["num_tokens"],)
            )
            self._maps[number] = tokens
        return tokens

    def _check_sizes(self) -> None:
        if sum(s["num_tokens"] for s in self.shards) != self.num_tokens:
            raise ConfigError(f"'{self.path / MANIFEST}': its shards do not add up to num_tokens")
        for shard in self.shards:
            for key, count, itemsize in (
                ("file", shard["num_tokens"], self.dtype.itemsize),
                ("index", shard["num_documents"], INDEX_DTYPE.itemsize),
            ):
                path = self.path / shard[key]
                if not path.is_file():
                    raise ConfigError(f"missing shard: file '{path}' (listed in {MANIFEST})")
                size = path.stat().st_size
                if size != count * itemsize:
                    raise ConfigError(
                        f"corrupt shard: file '{path}' has {size} bytes, expected "
                        f"{count * itemsize} (as {MANIFEST} says)"
                    )
        if not self.tokenizer_dir.is_dir():
            raise ConfigError(f"missing tokenizer: '{self.tokenizer_dir}' (listed in {MANIFEST})")

    @functools.cached_property
    def tokenizer_identity(self) -> str:
        """What its tokenizer is (data/prepare/tokenizer.py `tokenizer_identity`), read when first asked:
        sources of one tokenizer mix, whatever bytes its saved files hold."""
        return tokenizer_identity(self.tokenizer_dir)

    def __getstate__(self) -> dict:  # memory maps are reopened in the receiving process
        return {**self.__dict__, "_maps": {}}


def _read_manifest(path: Path) -> dict:
    if not path.is_dir():
        raise ConfigError(
            f"'{path}' is not a directory of prepared data; make one with `bigtrain prepare "
            f"CONFIG --out {path}`"
        )
    file = path / MANIFEST
    if not file.is_file():
        if (path / "progress.json").is_file():
            raise ConfigError(
                f"'{path}' is incomplete: it has no {MANIFEST} (`bigtrain prepare` did not "
                "finish); run the same `bigtrain prepare` command again to resume it"
            )
        raise ConfigError(
            f"'{path}' has no {MANIFEST}: it is not prepared data; make it with `bigtrain "
            f"prepare CONFIG --out {path}`"
        )
    try:
        manifest = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"'{file}' is not readable JSON: {e}") from None
    found = manifest.get("format") if isinstance(manifest, dict) else None
    if found != FORMAT:
        raise ConfigError(
            f"'{file}' has format {found!r}, expected '{FORMAT}' (prepared by another version of "
            "bigtrain? prepare it again)"
        )
    if manifest.get("dtype") not in DTYPES:
        raise ConfigError(f"'{file}': dtype {manifest.get('dtype')!r}, expected one of {DTYPES}")
    return manifest


def _stat_key(path: Path) -> list[int]:
    # The ctime too: every write in place changes it, even when the mtime is set back (os.utime
    # sets only atime and mtime), so such a file is hashed again rather than passed as verified.
    # Caught here, at setup on rank 0, every rank exits 2 together before a step; a check of each
    # batch in the loader would stop one rank while the others wait in a collective.
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _verify(data: PreparedData) -> None:
    """sha256 of every shard file against the manifest, skipping those stamped as verified; each
    token file's largest id against the vocabulary."""
    stamp = _read_stamp(data.path)
    fresh = {}
    for shard in data.shards:
        fresh[shard["index"]] = _checked(data, shard["index"], shard["index_sha256"], stamp)
        entry = _checked(data, shard["file"], shard["sha256"], stamp, tokens=True)
        if entry["max_token"] >= data.vocab_size:
            raise ConfigError(
                f"bad token ids: file '{data.path / shard['file']}' holds token id "
                f"{entry['max_token']}, beyond the vocabulary of {data.vocab_size} ids "
                f"(vocab_size in {MANIFEST}): not ids of its tokenizer; prepare the corpus again"
            )
        fresh[shard["file"]] = entry
    if tokenizer_sha256(data.tokenizer_dir) != data.tokenizer_sha256:
        raise ConfigError(
            f"corrupt tokenizer: '{data.tokenizer_dir}' differs from the sha256 in {MANIFEST}"
        )
    if fresh != stamp:
        _write_stamp(data.path, fresh)


def _checked(
    data: PreparedData, name: str, expected: str, stamp: dict, tokens: bool = False
) -> dict:
    """The stamp entry of a shard file: its stamped one if the file did not change since, else
    the file hashed (and, for `tokens`, its largest id read)."""
    path = data.path / name
    entry: dict = {"stat": _stat_key(path), "sha256": expected}
    stamped = stamp.get(name)
    unchanged = isinstance(stamped, dict) and all(stamped.get(k) == v for k, v in entry.items())
    if unchanged and (not tokens or isinstance(stamped.get("max_token"), int)):
        return stamped
    if file_sha256(path) != expected:
        raise ConfigError(
            f"corrupt shard: file '{path}' (its sha256 differs from {MANIFEST}); prepare the "
            "corpus again"
        )
    if tokens:  # right after hashing it: the file is in the page cache
        ids = np.memmap(path, data.dtype, mode="r")
        entry["max_token"] = int(ids.max()) if len(ids) else -1
    return entry


def record_verified(path: Path, manifest: dict) -> None:
    """Stamp the shard files of `manifest` as verified by the writer, which hashed them and
    recorded each token file's largest id. A shard recorded without it (by a bigtrain before
    `max_token`, in a prepare resumed since) is left to the first open to hash."""
    stamp = {}
    for shard in manifest["shards"]:
        if "max_token" in shard:
            stamp[shard["file"]] = {
                "stat": _stat_key(path / shard["file"]),
                "sha256": shard["sha256"],
                "max_token": shard["max_token"],
            }
            stamp[shard["index"]] = {
                "stat": _stat_key(path / shard["index"]),
                "sha256": shard["index_sha256"],
            }
    _write_stamp(path, stamp)


def _read_stamp(path: Path) -> dict:
    try:
        stamp = json.loads((path / STAMP).read_text())
    except (OSError, ValueError):
        return {}
    return stamp if isinstance(stamp, dict) else {}


def _write_stamp(path: Path, stamp: dict) -> None:
    # A read-only directory is verified again at every open, that is all.
    with contextlib.suppress(OSError):
        write_json_atomic(path / STAMP, stamp)
