"""`bigtrain prepare`: a corpus (`data.*`) -> a directory of token shards, its tokenizer and a
manifest, written in one streaming pass (two with a BPE to train), memory independent of the
corpus's size (docs/data.md):

    DIR/manifest.json     written last: a directory without it is incomplete
    DIR/shard_XXXXX.bin   tokens, every document followed by EOS (see data/prepare/shards.py)
    DIR/shard_XXXXX.idx   each document's end offset in its shard
    DIR/tokenizer/        the transformers tokenizer that made them

Resumable: each finished shard is recorded in DIR/progress.json once it is on disk. A rerun with
the same corpus and tokenizer keeps the recorded shards whose sha256 still match, deletes the rest
(a half-written one), skips the documents the kept shards hold and goes on; the result is byte for
byte that of an uninterrupted run. Anything else in the progress file (another corpus, changed
files, another tokenizer or shard size) starts over.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
import shutil
import sys
from pathlib import Path

import numpy as np

from bigtrain.config.schema import DataConfig
from bigtrain.data.prepare.encode import Encoder, encode_batches
from bigtrain.data.prepare.shards import ShardWriter, intact_prefix, remove_shards
from bigtrain.data.prepare.summary import CorpusSummary
from bigtrain.data.prepare.tokenizer import (
    load_tokenizer,
    tokenizer_key,
    tokenizer_sha256,
    train_bpe,
)
from bigtrain.data.read.prepared import FORMAT, MANIFEST, TOKENIZER, record_verified
from bigtrain.data.text.corpus import Documents, corpus_fingerprint, corpus_inputs
from bigtrain.errors import ConfigError
from bigtrain.utils.files import write_json_atomic
from bigtrain.utils.version import BIGTRAIN_VERSION

logger = logging.getLogger(__name__)

DEFAULT_SHARD_TOKENS = 1 << 27
"""134M tokens: 256 MiB per shard in uint16, 512 MiB in uint32."""
PROGRESS = "progress.json"
PROGRESS_FORMAT = "bigtrain-prepare-progress-1"
SOURCE_KEYS = (
    "source",
    "paths",
    "hub_name",
    "split",
    "text_key",
    "skip_bad_rows",
    "skip_empty_files",
    "tokenizer",
    "vocab_size",
)
"""The `data.*` keys that define a prepared corpus (the manifest's `source`)."""
_OWN = re.compile(
    r"shard_\d{5,}\.(bin|idx)|manifest\.json|progress\.json|tokenizer(\.tmp)?|\.verified\.json"
    r"|inputs\.txt|\..+\.tmp-.+"
)
INPUTS = "inputs.txt"
"""Every input the corpus was read from, one per line (the manifest counts them)."""


def prepare(
    data_cfg: DataConfig,
    out_dir: str | Path,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    progress: bool = True,
    shown_as: Path | None = None,
) -> dict:
    """Tokenize the corpus of `data_cfg` into `out_dir` (new, empty, or a killed run's to resume);
    returns the manifest. `progress`: a tqdm bar on a terminal. `shown_as`: where the result
    lands, for the log line (a temporary `out_dir` is renamed there)."""
    out = Path(out_dir)
    if shard_tokens < 1:
        raise ConfigError(f"prepare: shard_tokens got {shard_tokens}, expected a positive count")
    docs = Documents(data_cfg)  # checks paths and formats before anything is written
    made = _outermost_missing(out)
    _check_out_dir(out)
    try:
        manifest = _prepare_into(data_cfg, docs, out, shard_tokens, progress)
    except Exception:
        # What a rerun could not keep goes: a directory this call made that holds no finished
        # shard. An interrupted run (KeyboardInterrupt, a kill) keeps its progress to resume.
        if made is not None and not _holds_progress(out):
            shutil.rmtree(made, ignore_errors=True)
        raise
    inputs = corpus_inputs(data_cfg, docs.files)
    summary = CorpusSummary(
        data_cfg.source, inputs, manifest["num_documents"], manifest["num_tokens"]
    )
    logger.info(
        "prepare: read %s in %d shard(s) -> %s",
        summary.describe(),
        len(manifest["shards"]),
        shown_as or out,
    )
    return manifest


def _prepare_into(
    data_cfg: DataConfig, docs: Documents, out: Path, shard_tokens: int, progress: bool
) -> dict:
    """prepare() in the checked output directory `out`; returns the manifest."""
    expect = {
        "format": PROGRESS_FORMAT,
        "source": source_of(data_cfg),
        "fingerprint": f"{corpus_fingerprint(data_cfg)}|{tokenizer_key(data_cfg)}",
        "shard_tokens": shard_tokens,
    }
    finished = _resumable_shards(out, expect)
    if finished is None:
        _clear(out)
        finished = []
        _make_tokenizer(data_cfg, docs, out, progress)
    elif finished:
        logger.info("prepare: resuming %s after %d finished shard(s)", out, len(finished))
    tokenizer = load_tokenizer(str(out / TOKENIZER))
    if not tokenizer.is_fast:
        raise ConfigError(
            f"data.tokenizer '{data_cfg.tokenizer}' has no fast (Rust) tokenizer; "
            "bigtrain prepare needs one (a tokenizer.json)"
        )
    vocab_size, eos_id = len(tokenizer), int(tokenizer.eos_token_id)
    dtype = "uint16" if vocab_size <= np.iinfo(np.uint16).max + 1 else "uint32"
    state = {**expect, "tokenizer_sha256": tokenizer_sha256(out / TOKENIZER), "dtype": dtype}
    write_json_atomic(out / PROGRESS, {**state, "shards": finished})
    remove_shards(out, len(finished))
    encoder = Encoder(tokenizer.backend_tokenizer.to_str(), eos_id, dtype)
    shards = _write_shards(out, docs, encoder, state, finished, data_cfg.num_proc, progress)
    if not shards:
        raise ConfigError(f"data: the corpus of source={data_cfg.source} holds no documents")
    inputs = corpus_inputs(data_cfg, docs.files)
    manifest = {
        "format": FORMAT,
        "bigtrain_version": BIGTRAIN_VERSION,
        "dtype": dtype,
        "num_tokens": sum(s["num_tokens"] for s in shards),
        "num_documents": sum(s["num_documents"] for s in shards),
        "eos_id": eos_id,
        "vocab_size": vocab_size,
        "tokenizer": {"dir": TOKENIZER, "sha256": state["tokenizer_sha256"]},
        "source": expect["source"],
        "num_inputs": len(inputs),
        "inputs": INPUTS,
        "skipped_rows": docs.skipped_rows,
        "skipped_files": docs.skipped_summary(),
        "shards": shards,
    }
    (out / INPUTS).write_text("".join(f"{i}\n" for i in inputs))
    write_json_atomic(out / MANIFEST, manifest)  # last: the directory is complete
    record_verified(out, manifest)  # the writer hashed every file: the first open need not
    (out / PROGRESS).unlink()
    return manifest


def _write_shards(
    out: Path,
    docs: Documents,
    encoder: Encoder,
    state: dict,
    finished: list[dict],
    num_proc: int,
    progress: bool,
) -> list[dict]:
    """Tokenize the documents that `finished` shards do not hold yet into further shards, each
    recorded in the progress file (`state` plus the shards so far) once it is on disk."""

    def record(shards: list[dict]) -> None:
        write_json_atomic(out / PROGRESS, {**state, "shards": shards})

    writer = ShardWriter(out, state["dtype"], state["shard_tokens"], finished, record)
    texts = itertools.islice(iter(docs), writer.num_documents, None)
    with _bar(docs.total_bytes, "tokenize", progress) as bar:
        try:
            for tokens, lengths in encode_batches(texts, encoder, num_proc):
                writer.add(tokens, lengths)
                bar.update(docs.bytes_read - bar.n)
        except BaseException:
            writer.abandon()
            raise
        bar.update(docs.bytes_read - bar.n)
        return writer.close()


def source_of(data_cfg: DataConfig) -> dict:
    """The manifest's `source`: the data.* keys that define the corpus."""
    source = {key: getattr(data_cfg, key) for key in SOURCE_KEYS}
    source["paths"] = list(source["paths"])
    return source


def _check_out_dir(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise ConfigError(f"prepare: the output directory '{out}' is a file")
    if (out / MANIFEST).exists():
        raise ConfigError(
            f"prepare: '{out}' already holds a prepared corpus ({MANIFEST}); choose another "
            "output directory or remove it"
        )
    if out.is_dir():
        foreign = sorted(p.name for p in out.iterdir() if not _OWN.fullmatch(p.name))
        if foreign:
            raise ConfigError(
                f"prepare: '{out}' holds files that bigtrain prepare did not write (such as "
                f"'{foreign[0]}'); use a new or empty output directory"
            )
    out.mkdir(parents=True, exist_ok=True)


def _outermost_missing(path: Path) -> Path | None:
    """The outermost of `path` and its parents that does not exist: what mkdir(parents=True)
    makes. None when `path` exists."""
    if path.exists():
        return None
    while not path.parent.exists():
        path = path.parent
    return path


def _holds_progress(out: Path) -> bool:
    """`out` holds a finished corpus or finished shards of one (recorded in the progress file)."""
    if (out / MANIFEST).exists():
        return True
    try:
        return bool(json.loads((out / PROGRESS).read_text())["shards"])
    except (OSError, ValueError, KeyError, TypeError):  # no progress file, or not one of ours
        return False


def _resumable_shards(out: Path, expect: dict) -> list[dict] | None:
    """The shards of a killed run on the same corpus and tokenizer that are intact on disk; None
    when there is nothing to resume."""
    try:
        done = json.loads((out / PROGRESS).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(done, dict) or any(done.get(k) != v for k, v in expect.items()):
        return None
    tokenizer = out / TOKENIZER
    if not tokenizer.is_dir() or tokenizer_sha256(tokenizer) != done.get("tokenizer_sha256"):
        return None
    try:
        return intact_prefix(out, done["shards"], np.dtype(done["dtype"]))
    except (KeyError, TypeError, ValueError):  # a progress file this code did not write
        return None


def _clear(out: Path) -> None:
    """Remove what an earlier, unresumable run left."""
    remove_shards(out, 0)
    for name in (TOKENIZER, TOKENIZER + ".tmp"):
        shutil.rmtree(out / name, ignore_errors=True)
    for name in (PROGRESS, ".verified.json"):
        (out / name).unlink(missing_ok=True)


def _make_tokenizer(data_cfg: DataConfig, docs: Documents, out: Path, progress: bool) -> None:
    """DIR/tokenizer: a BPE trained on the documents (a first pass), or data.tokenizer saved."""
    tmp = out / (TOKENIZER + ".tmp")
    if data_cfg.tokenizer == "bpe":
        with _bar(docs.total_bytes, "train bpe", progress) as bar:

            def texts():
                for text in docs:
                    yield text
                    bar.update(docs.bytes_read - bar.n)

            train_bpe(texts(), data_cfg.vocab_size, tmp)
            bar.update(docs.bytes_read - bar.n)
    else:
        load_tokenizer(data_cfg.tokenizer).save_pretrained(str(tmp))
    tmp.rename(out / TOKENIZER)


def _bar(total: int | None, desc: str, enabled: bool):
    """A tqdm bar of input bytes (MB/s, and an ETA when `total` is known); off unless on a
    terminal."""
    from tqdm import tqdm

    return tqdm(
        total=total,
        desc=f"prepare: {desc}",
        unit="B",
        unit_scale=True,
        mininterval=1.0,
        disable=not (enabled and sys.stderr.isatty()),
    )
