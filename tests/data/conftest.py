"""Fixtures of the prepare tests: a small BPE trained once, and documents as jsonl."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bigtrain.config.schema import DataConfig
from bigtrain.data.tokenizer import load_tokenizer, train_bpe


@pytest.fixture(scope="session")
def paragraphs(corpus_files) -> list[str]:
    """About 600 documents of real text: the paragraphs of a play."""
    return [p for p in corpus_files[0].read_text().split("\n\n") if p.strip()][:600]


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory, paragraphs) -> Path:
    """A 300-token BPE trained once, used as data.tokenizer (so most tests train none)."""
    out = tmp_path_factory.mktemp("bpe300") / "tokenizer"
    train_bpe(paragraphs, 300, out)
    return out


def write_jsonl(path: Path, texts: list[str], key: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({key: t}) + "\n" for t in texts))
    return path


def jsonl_cfg(path: Path, tokenizer: Path, **kwargs) -> DataConfig:
    return DataConfig(source="files", paths=[str(path)], tokenizer=str(tokenizer), **kwargs)


def expected_tokens(texts: list[str], tokenizer: Path) -> tuple[np.ndarray, np.ndarray]:
    """What the old path wrote: each document's ids from the transformers tokenizer, then EOS;
    and each document's length (EOS included)."""
    tok = load_tokenizer(str(tokenizer))
    ids = [x + [tok.eos_token_id] for x in tok(texts, add_special_tokens=False)["input_ids"]]
    return np.array([t for x in ids for t in x], np.int64), np.array([len(x) for x in ids])
