"""Tokenizer and token array: the corpus tokenized once, cached, packed into fixed-length samples.

Cache layout (`data.cache_dir`, keyed by corpus fingerprint and tokenizer):
    corpus-<key>/tokenizer/      a transformers tokenizer directory (trained BPE only)
    corpus-<key>/tokens.bin      all documents' ids, each followed by EOS (uint16 or uint32)
    corpus-<key>/meta.json       dtype, token count, vocab size, eos id, rows skipped per file
                                 (data.skip_bad_rows); written last
Entries are built in a temporary directory and renamed into place, so a crash never leaves a
half-written cache behind.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bigtrain.config.schema import DataConfig
from bigtrain.data.corpus import corpus_fingerprint, load_documents
from bigtrain.errors import ConfigError

logger = logging.getLogger(__name__)

EOS = "<|endoftext|>"


def cache_root(cfg: DataConfig) -> Path:
    root = cfg.cache_dir or os.environ.get("BIGTRAIN_CACHE") or Path.home() / ".cache" / "bigtrain"
    return Path(root)


@dataclass
class TokenCorpus:
    """The packed corpus: a read-only memmap of ids plus what the model needs to know."""

    tokens: np.ndarray
    vocab_size: int
    eos_id: int
    tokenizer_dir: str
    key: str
    skipped_rows: dict[str, int] = field(default_factory=dict)
    """Resolved file path -> rows that data.skip_bad_rows left out when the cache entry was built
    (their text_key was missing, null or not a string); empty when none were."""

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


def train_bpe(texts, vocab_size: int, out_dir: Path) -> None:
    """Train a byte-level BPE with `tokenizers` and save it as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS).save_pretrained(str(out_dir))


def load_tokenizer(name_or_dir: str):
    """A transformers tokenizer from a local directory or a hub name."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(name_or_dir)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"data.tokenizer: cannot load '{name_or_dir}': {e}".splitlines()[0]
        ) from None
    if tok.eos_token_id is None:
        raise ConfigError(
            f"data.tokenizer '{name_or_dir}' has no EOS token (needed between documents)"
        )
    return tok


def _tokenizer_key(cfg: DataConfig) -> str:
    if cfg.tokenizer == "bpe":
        return f"bpe{cfg.vocab_size}"
    path = Path(cfg.tokenizer)
    if path.is_dir():  # a local tokenizer: its files are its identity
        h = hashlib.sha256()
        for f in sorted(path.iterdir()):
            if f.is_file():
                h.update(f.name.encode() + f.read_bytes())
        return "dir" + h.hexdigest()[:12]
    return "hub-" + cfg.tokenizer


def cache_entry(cfg: DataConfig) -> Path:
    """The cache directory of this corpus and tokenizer (it may not exist yet)."""
    key = hashlib.sha256(f"{corpus_fingerprint(cfg)}|{_tokenizer_key(cfg)}".encode()).hexdigest()
    return cache_root(cfg) / f"corpus-{key[:16]}"


def prepare_corpus(cfg: DataConfig) -> TokenCorpus:
    """Tokenize the corpus (or reuse the cache) and return the packed token memmap."""
    entry = cache_entry(cfg)
    key = entry.name.removeprefix("corpus-")
    if not (entry / "meta.json").is_file():
        logger.info("data: tokenizing the corpus into %s", entry)
        _build_entry(cfg, entry)
    meta = json.loads((entry / "meta.json").read_text())
    tokens = np.memmap(
        entry / "tokens.bin", dtype=meta["dtype"], mode="r", shape=(meta["num_tokens"],)
    )
    tokenizer_dir = str(entry / "tokenizer") if cfg.tokenizer == "bpe" else cfg.tokenizer
    skipped = meta.get("skipped_rows", {})  # absent from entries built before the field existed
    if skipped:
        logger.warning(
            "data: %d rows without a string '%s' were skipped (data.skip_bad_rows): %s",
            sum(skipped.values()),
            cfg.text_key,
            skipped,
        )
    return TokenCorpus(tokens, meta["vocab_size"], meta["eos_id"], tokenizer_dir, key, skipped)


def _build_entry(cfg: DataConfig, entry: Path) -> None:
    """Tokenize into a temporary directory beside `entry` and rename it into place; on any error
    the temporary directory goes, so no partial entry is left behind."""
    import datasets

    datasets.disable_progress_bars()
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=entry.name + ".tmp-", dir=entry.parent))
    try:
        docs = load_documents(cfg)
        if len(docs.dataset) == 0:
            raise ConfigError(f"data: the corpus of source={cfg.source} holds no documents")
        if cfg.tokenizer == "bpe":
            texts = (row["text"] for row in docs.dataset)
            train_bpe(texts, cfg.vocab_size, tmp / "tokenizer")
            tokenizer = load_tokenizer(str(tmp / "tokenizer"))
        else:
            tokenizer = load_tokenizer(cfg.tokenizer)
        meta = _write_tokens(docs.dataset, tokenizer, cfg.num_proc, tmp / "tokens.bin")
        meta["skipped_rows"] = docs.skipped_rows
        (tmp / "meta.json").write_text(json.dumps(meta))
        try:
            tmp.rename(entry)
        except OSError:  # another process built the same entry first: keep theirs
            if not (entry / "meta.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_tokens(docs, tokenizer, num_proc: int, path: Path) -> dict:
    """Encode every document, EOS after each, into `path`; the meta.json fields that describe it."""
    eos = tokenizer.eos_token_id
    vocab_size = len(tokenizer)
    dtype = np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32

    def encode(batch):
        ids = tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
        return {"ids": [x + [eos] for x in ids], "n": [len(x) + 1 for x in ids]}

    encoded = docs.map(encode, batched=True, remove_columns=docs.column_names, num_proc=num_proc)
    total = int(sum(encoded["n"]))
    out = np.memmap(path, dtype=dtype, mode="w+", shape=(total,))
    pos = 0
    for batch in encoded.iter(batch_size=256):
        flat = np.fromiter((t for doc in batch["ids"] for t in doc), dtype=dtype)
        out[pos : pos + flat.size] = flat
        pos += flat.size
    out.flush()
    del out
    return {
        "dtype": np.dtype(dtype).name,
        "num_tokens": total,
        "vocab_size": vocab_size,
        "eos_id": eos,
    }
