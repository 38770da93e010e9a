"""Fixtures of the data tests: a small BPE trained once, documents as jsonl (prepare), and two
prepared directories with a real tokenizer (mixtures, whole runs)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bigtrain.config.schema import DataConfig
from bigtrain.data.prepare.tokenizer import load_tokenizer, train_bpe
from tests.data.prepared_dirs import random_documents, write_prepared


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


@pytest.fixture(scope="session")
def mixture_sources(tmp_path_factory, corpus_files) -> dict[str, Path]:
    """Two prepared directories with one real BPE tokenizer: `big` (~6k tokens) and `small`
    (~420 tokens, about 50 sequences of 8: it runs out in the first block of 1024 positions)."""
    root = tmp_path_factory.mktemp("prepared")
    text = corpus_files[0].read_text()[:20_000].splitlines()
    train_bpe(iter(text), 300, root / "tokenizer")
    vocab = len(load_tokenizer(str(root / "tokenizer")))
    eos = load_tokenizer(str(root / "tokenizer")).eos_token_id
    return {
        name: write_prepared(
            root / name,
            random_documents(seed, num_tokens, vocab_size=vocab, low=eos + 1),
            root / "tokenizer",
            eos_id=eos,
            vocab_size=vocab,
        )
        for seed, (name, num_tokens) in enumerate({"big": 6000, "small": 400}.items())
    }


def mixture_args(sources: dict[str, Path]) -> list[str]:
    return [
        "data.source=prepared",
        "data.paths=[]",  # the micro config's files: paths with another source are an error
        f"data.mixture=[{{path: {sources['big']}}}, {{path: {sources['small']}, max_epochs: 1}}]",
        "model.seq_len=8",
        "train.micro_batch_size=256",  # 6 steps cover more than one block of 1024 positions
        "train.max_steps=6",
        "train.log_every=2",
        "train.eval_every=6",
        "checkpoint.every=3",
    ]
