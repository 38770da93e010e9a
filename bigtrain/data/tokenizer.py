"""Tokenizers: a byte-level BPE trained on the corpus, or a transformers tokenizer by name or
directory; and what identifies one (for cache keys, manifests and resuming)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

from bigtrain.config.schema import DataConfig
from bigtrain.errors import ConfigError

EOS = "<|endoftext|>"


def train_bpe(texts: Iterable[str], vocab_size: int, out_dir: Path) -> None:
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


def tokenizer_sha256(directory: Path) -> str:
    """sha256 over a tokenizer directory's files (sorted by name): each name's bytes, then its
    content's."""
    h = hashlib.sha256()
    for f in sorted(directory.iterdir()):
        if f.is_file():
            h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


def tokenizer_key(cfg: DataConfig) -> str:
    """What identifies `data.tokenizer` before it is loaded: the BPE's size, a local directory's
    files, or a hub name."""
    if cfg.tokenizer == "bpe":
        return f"bpe{cfg.vocab_size}"
    path = Path(cfg.tokenizer)
    if path.is_dir():  # a local tokenizer: its files are its identity
        return "dir" + tokenizer_sha256(path)[:12]
    return "hub-" + cfg.tokenizer
