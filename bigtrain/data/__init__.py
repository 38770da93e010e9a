"""Data, in three stages: text in (text/: documents from files, rows or the shipped plays), text
to token shards with a manifest (prepare/: tokenizer, encoding, shards, `bigtrain prepare`, a run's
own cached corpus), and token shards to batches (read/: the one prepared-data reader, mixtures, the
deterministic, resumable, skippable stream per data-parallel rank)."""

from bigtrain.data.prepare.cache import TokenCorpus, load_tokenizer, prepare_corpus
from bigtrain.data.read.prepared import PreparedData
from bigtrain.data.read.stream import (
    BatchLoader,
    PackedSamples,
    SampleStream,
    TrainingData,
    eval_batches,
    from_corpus,
    split_samples,
)
from bigtrain.data.text.corpus import Documents, strip_play_markup

__all__ = [
    "BatchLoader",
    "Documents",
    "PackedSamples",
    "PreparedData",
    "SampleStream",
    "TokenCorpus",
    "TrainingData",
    "eval_batches",
    "from_corpus",
    "load_tokenizer",
    "prepare_corpus",
    "split_samples",
    "strip_play_markup",
]
