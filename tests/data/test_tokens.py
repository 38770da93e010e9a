import numpy as np
import pytest

from bigtrain.config.schema import DataConfig
from bigtrain.data import load_tokenizer, prepare_corpus
from bigtrain.errors import ConfigError


def test_bpe_corpus_is_cached_and_decodes(tmp_path, corpus_files):
    cfg = DataConfig(
        source="files",
        paths=[str(p) for p in corpus_files],
        vocab_size=384,
        cache_dir=str(tmp_path),
    )
    logs = []
    corpus = prepare_corpus(cfg, log=logs.append)
    assert corpus.vocab_size == 384
    assert corpus.tokens.dtype == np.uint16
    assert int(corpus.tokens.max()) < 384
    # one EOS after each document
    assert int((np.asarray(corpus.tokens) == corpus.eos_id).sum()) == len(corpus_files)
    tok = load_tokenizer(corpus.tokenizer_dir)
    text = corpus_files[0].read_text()
    assert (
        tok.decode(list(corpus.tokens[:200])) == text[: len(tok.decode(list(corpus.tokens[:200])))]
    )
    # a second call reuses the cache: no tokenizing, same array
    again = prepare_corpus(cfg, log=logs.append)
    assert len(logs) == 1
    assert np.array_equal(np.asarray(again.tokens), np.asarray(corpus.tokens))


def test_local_tokenizer_directory(tmp_path, corpus_files):
    bpe = prepare_corpus(
        DataConfig(
            source="files",
            paths=[str(p) for p in corpus_files],
            vocab_size=300,
            cache_dir=str(tmp_path),
        )
    )
    cfg = DataConfig(
        source="files",
        paths=[str(corpus_files[0])],
        tokenizer=bpe.tokenizer_dir,
        cache_dir=str(tmp_path),
    )
    corpus = prepare_corpus(cfg)
    assert corpus.vocab_size == 300
    assert corpus.tokenizer_dir == bpe.tokenizer_dir


def test_missing_tokenizer_is_a_config_error(tmp_path, corpus_files):
    cfg = DataConfig(
        source="files",
        paths=[str(corpus_files[0])],
        tokenizer=str(tmp_path / "nope"),
        cache_dir=str(tmp_path),
    )
    with pytest.raises(ConfigError, match="data.tokenizer"):
        prepare_corpus(cfg)


def test_missing_data_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="matches no file"):
        prepare_corpus(
            DataConfig(source="files", paths=[str(tmp_path / "none*.txt")], cache_dir=str(tmp_path))
        )
