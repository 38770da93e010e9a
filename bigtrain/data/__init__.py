"""Corpus -> prepared token shards -> packed samples -> a deterministic, resumable, skippable
stream per rank."""

from bigtrain.data.corpus import Documents, strip_play_markup
from bigtrain.data.prepared import PreparedData
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
    "Documents",
    "PackedSamples",
    "PreparedData",
    "SampleStream",
    "TokenCorpus",
    "eval_batches",
    "load_tokenizer",
    "prepare_corpus",
    "split_samples",
    "strip_play_markup",
]
