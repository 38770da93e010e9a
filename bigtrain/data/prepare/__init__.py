"""Text to token shards: the tokenizer (trained byte-level BPE or a transformers one), documents
encoded in order (encode.py), shards written and their format (shards.py), `bigtrain prepare`
itself (run.py), the corpus summary it records (summary.py), and a run's own corpus tokenized once
and cached in the same format (cache.py)."""
