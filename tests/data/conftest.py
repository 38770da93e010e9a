"""Fixtures of the data tests: two prepared directories with a real tokenizer, for whole runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from bigtrain.data.tokens import load_tokenizer, train_bpe
from tests.data.prepared_dirs import random_documents, write_prepared


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
        f"data.mixture=[{{path: {sources['big']}}}, {{path: {sources['small']}, max_epochs: 1}}]",
        "model.seq_len=8",
        "train.micro_batch_size=256",  # 6 steps cover more than one block of 1024 positions
        "train.max_steps=6",
        "train.log_every=2",
        "train.eval_every=6",
        "checkpoint.every=3",
    ]
