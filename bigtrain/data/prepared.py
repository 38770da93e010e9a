"""Reader of a directory written by `bigtrain prepare` (format `bigtrain-prepared-1`).

A minimal stand-in: the `prepare` branch brings the full reader with the same API; mixtures use
only `open`, the attributes below, `len()` and slicing.

    DIR/manifest.json        format, dtype, num_tokens, num_documents, eos_id, vocab_size,
                             tokenizer {dir, sha256}, shards [{file, index, num_tokens, ...}]
    DIR/shard_XXXXX.bin      raw little-endian tokens, every document followed by EOS
    DIR/shard_XXXXX.idx      raw uint64 document end offsets
    DIR/tokenizer/           a transformers tokenizer directory
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from bigtrain.errors import ConfigError

FORMAT = "bigtrain-prepared-1"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class PreparedData:
    """The token stream of a prepared directory: all shards in order, sliced like one array."""

    def __init__(self, path: Path, manifest: dict[str, Any], shards: list[np.ndarray]) -> None:
        self.path, self.manifest, self._shards = path, manifest, shards
        self.name = path.name
        self.dtype = np.dtype(manifest["dtype"])
        self.num_tokens = int(manifest["num_tokens"])
        self.num_documents = int(manifest["num_documents"])
        self.eos_id = int(manifest["eos_id"])
        self.vocab_size = int(manifest["vocab_size"])
        self.tokenizer_dir = path / manifest["tokenizer"]["dir"]
        self.tokenizer_sha256 = str(manifest["tokenizer"]["sha256"])
        self._starts = np.cumsum([0] + [len(s) for s in shards])

    @classmethod
    def open(cls, path: str | Path, verify: bool = True) -> PreparedData:
        """Open DIR; with `verify`, every shard's and index's sha256 is checked."""
        path = Path(path)
        manifest_file = path / "manifest.json"
        if not manifest_file.is_file():
            raise ConfigError(
                f"'{path}' is not a prepared directory: {manifest_file} is missing "
                "(write one with `bigtrain prepare`)"
            )
        try:
            manifest = json.loads(manifest_file.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"{manifest_file} is not valid JSON: {e}") from None
        if manifest.get("format") != FORMAT:
            raise ConfigError(
                f"{manifest_file}: format {manifest.get('format')!r}, expected {FORMAT!r}"
            )
        shards = [cls._open_shard(path, s, manifest["dtype"], verify) for s in manifest["shards"]]
        return cls(path, manifest, shards)

    @staticmethod
    def _open_shard(path: Path, shard: dict[str, Any], dtype: str, verify: bool) -> np.ndarray:
        file, index = path / shard["file"], path / shard["index"]
        for f in (file, index):
            if not f.is_file():
                raise ConfigError(f"{f} is missing (listed in {path / 'manifest.json'})")
        size = int(shard["num_tokens"]) * np.dtype(dtype).itemsize
        if file.stat().st_size != size:
            raise ConfigError(
                f"{file} holds {file.stat().st_size} bytes, expected {size} "
                f"({shard['num_tokens']} tokens of {dtype}): truncated or corrupt"
            )
        if verify:
            for f, key in ((file, "sha256"), (index, "index_sha256")):
                if _sha256(f) != shard[key]:
                    raise ConfigError(f"{f}: sha256 differs from the manifest's: corrupt")
        if size == 0:
            return np.zeros(0, dtype=dtype)
        return np.memmap(file, dtype=np.dtype(dtype).newbyteorder("<"), mode="r")

    def __len__(self) -> int:
        return self.num_tokens

    def __getitem__(self, key: slice) -> np.ndarray:
        """Tokens [start, stop) across shard boundaries (a step other than 1 is not supported)."""
        start, stop, step = key.indices(self.num_tokens)
        assert step == 1, "prepared data is sliced with step 1"
        first = int(np.searchsorted(self._starts, start, side="right")) - 1
        parts = []
        while start < stop:
            lo = start - int(self._starts[first])
            take = min(stop - start, len(self._shards[first]) - lo)
            parts.append(np.asarray(self._shards[first][lo : lo + take]))
            start += take
            first += 1
        if not parts:
            return np.zeros(0, dtype=self.dtype)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)
