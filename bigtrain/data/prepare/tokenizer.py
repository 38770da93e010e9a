"""Tokenizers: a byte-level BPE trained on the corpus, or a transformers tokenizer by name or
directory; and what identifies one (for cache keys, manifests and resuming)."""

from __future__ import annotations

import hashlib
import json
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

    _check_not_prepared(Path(name_or_dir))
    try:
        tok = AutoTokenizer.from_pretrained(name_or_dir)
    except (OSError, ValueError) as e:
        reason = " ".join(str(e).split())  # one line, all of it: transformers' run over several
        raise ConfigError(f"data.tokenizer: cannot load '{name_or_dir}': {reason}") from None
    if tok.eos_token_id is None:
        raise ConfigError(
            f"data.tokenizer '{name_or_dir}' has no EOS token (needed between documents)"
        )
    return tok


def _check_not_prepared(path: Path) -> None:
    """A prepared directory (or a run directory) holds its tokenizer in `tokenizer/`: the likely
    meaning of such a data.tokenizer, which transformers would refuse with a long message."""
    own = any((path / name).is_file() for name in TOKENIZER_FILES)
    if path.is_dir() and (path / "tokenizer").is_dir() and not own:
        raise ConfigError(
            f"data.tokenizer: '{path}' is a prepared corpus or a run directory, not a tokenizer; "
            f"use data.tokenizer={path / 'tokenizer'}"
        )


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
IDENTITY_KEYS = (
    "model",
    "added_tokens",
    "normalizer",
    "pre_tokenizer",
    "post_processor",
    "decoder",
)
"""The parts of tokenizer.json that decide the ids of a text: the vocabulary and merges (model),
the added and special tokens, and the steps around the model."""


def tokenizer_identity(directory: Path) -> str:
    """What makes two tokenizers the same, so that token ids from one mean the same with the
    other: sha256 over IDENTITY_KEYS of its tokenizer.json, as the `tokenizers` library writes it
    again (the same for files of other versions or formatting). Not the files' bytes: saving a
    tokenizer again adds keys to tokenizer_config.json (`is_local`, `local_files_only`) that
    change no id. Which token is EOS is compared on its own (a manifest's eos_id). A directory
    without a tokenizer.json (a slow tokenizer) is identified by its files' bytes."""
    from tokenizers import Tokenizer

    file = directory / "tokenizer.json"
    if not file.is_file():
        return "files-" + tokenizer_sha256(directory)
    try:
        content = json.loads(Tokenizer.from_file(str(file)).to_str())
    except Exception as e:  # tokenizers raises a bare Exception for a file it cannot read
        reason = " ".join(str(e).split())
        raise ConfigError(f"tokenizer: '{file}' is not a tokenizer file: {reason}") from None
    canonical = json.dumps([content.get(k) for k in IDENTITY_KEYS], sort_keys=True)
    return "content-" + hashlib.sha256(canonical.encode()).hexdigest()


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
