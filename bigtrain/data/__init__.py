"""Data: corpus -> prepared token shards with a manifest (prepare.py) -> packed samples -> a
deterministic, resumable, skippable stream per data-parallel rank (stream.py); mixtures of
prepared directories, tokenizers, the one prepared-data reader."""

from bigtrain.data.corpus import Documents, strip_play_markup
from bigtrain.data.prepared import PreparedData
from bigtrain.data.stream import (
    BatchLoader,
    PackedSamples,
    SampleStream,
    TrainingData,
    eval_batches,
    from_corpus,
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
    "TrainingData",
    "eval_batches",
    "from_corpus",
    "load_tokenizer",
    "prepare_corpus",
    "split_samples",
    "strip_play_markup",
]
