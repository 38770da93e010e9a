"""Corpus -> tokens -> packed samples -> a deterministic, resumable, skippable stream per rank."""

from bigtrain.data.corpus import load_documents, strip_play_markup
from bigtrain.data.stream import (
    BatchLoader,
    PackedSamples,
    SampleStream,
    eval_batches,
    split_samples,
)
from bigtrain.data.tokens import TokenCorpus, load_tokenizer, prepare_corpus

__all__ = [
    "BatchLoader",
    "PackedSamples",
    "SampleStream",
    "TokenCorpus",
    "eval_batches",
    "load_documents",
    "load_tokenizer",
    "prepare_corpus",
    "split_samples",
    "strip_play_markup",
]
