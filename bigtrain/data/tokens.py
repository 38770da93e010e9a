"""Tokenizer and token array: the corpus tokenized once, cached, packed into fixed-length samples.

Cache layout (`data.cache_dir`, keyed by corpus fingerprint and tokenizer):
    corpus-<key>/tokenizer/      a transformers tokenizer directory (trained BPE only)
    corpus-<key>/tokens.bin      all documents' ids, each followed by EOS (uint16 or uint32)
    corpus-<key>/meta.json       dtype, token count, vocab size, eos id; written last
Entries are built in a temporary directory and renamed into place, so a crash never leaves a
half-written cache behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bigtrain.config.schema import DataConfig
from bigtrain.data.corpus import corpus_fingerprint, load_documents
from bigtrain.errors import ConfigError

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


def prepare_corpus(cfg: DataConfig, log=print) -> TokenCorpus:
    """Tokenize the corpus (or reuse the cache) and return the packed token memmap."""
    entry = cache_entry(cfg)
    key = entry.name.removeprefix("corpus-")
    if not (entry / "meta.json").is_file():
        log(f"data: tokenizing the corpus into {entry}")
        _build_entry(cfg, entry)
    meta = json.loads((entry / "meta.json").read_text())
    tokens = np.memmap(
        entry / "tokens.bin", dtype=meta["dtype"], mode="r", shape=(meta["num_tokens"],)
    )
    tokenizer_dir = str(entry / "tokenizer") if cfg.tokenizer == "bpe" else cfg.tokenizer
    return TokenCorpus(tokens, meta["vocab_size"], meta["eos_id"], tokenizer_dir, key)


def _build_entry(cfg: DataConfig, entry: Path) -> None:
    import datasets

    datasets.disable_progress_bars()
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=entry.name + ".tmp-", dir=entry.parent))
    try:
        docs = load_documents(cfg)
        if len(docs) == 0:
            raise ConfigError(f"data: the corpus of source={cfg.source} holds no documents")
        if cfg.tokenizer == "bpe":
            train_bpe((row["text"] for row in docs), cfg.vocab_size, tmp / "tokenizer")
            tokenizer = load_tokenizer(str(tmp / "tokenizer"))
        else:
            tokenizer = load_tokenizer(cfg.tokenizer)
        eos = tokenizer.eos_token_id
        vocab_size = len(tokenizer)
        dtype = np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32

        def encode(batch):
            ids = tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
            return {"ids": [x + [eos] for x in ids], "n": [len(x) + 1 for x in ids]}

        encoded = docs.map(
            encode, batched=True, remove_columns=docs.column_names, num_proc=cfg.num_proc
        )
        total = int(sum(encoded["n"]))
        out = np.memmap(tmp / "tokens.bin", dtype=dtype, mode="w+", shape=(total,))
        pos = 0
        for batch in encoded.iter(batch_size=256):
            flat = np.fromiter((t for doc in batch["ids"] for t in doc), dtype=dtype)
            out[pos : pos + flat.size] = flat
            pos += flat.size
        out.flush()
        del out
        meta = {
            "dtype": np.dtype(dtype).name,
            "num_tokens": total,
            "vocab_size": vocab_size,
            "eos_id": eos,
        }
        (tmp / "meta.json").write_text(json.dumps(meta))
        try:
            tmp.rename(entry)
        except OSError:  # another process built the same entry first: keep theirs
            if not (entry / "meta.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
