"""Text in: the documents a corpus is made of, streamed (corpus.py: the shipped Shakespeare plays,
local text files, rows of jsonl/json/parquet files through rows.py, or a hub dataset) before any
tokenizer sees them."""
