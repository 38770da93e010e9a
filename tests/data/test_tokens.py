import json
import logging
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from bigtrain.config.schema import DataConfig
from bigtrain.data import load_tokenizer, prepare_corpus
from bigtrain.data.prepare.summary import CorpusSummary
from bigtrain.errors import ConfigError
from tests.conftest import run_cli


@pytest.mark.unit
def test_bpe_corpus_is_cached_and_decodes(tmp_path, corpus_files, caplog):
    cfg = DataConfig(
        source="files",
        paths=[str(p) for p in corpus_files],
        vocab_size=384,
        cache_dir=str(tmp_path),
    )
    caplog.set_level(logging.INFO, logger="bigtrain")
    corpus = prepare_corpus(cfg)
    assert corpus.vocab_size == 384
    assert corpus.summary == CorpusSummary(
        "files", [str(p) for p in corpus_files], len(corpus_files), len(corpus.tokens)
    )
    assert corpus.tokens.dtype == np.uint16
    assert int(np.asarray(corpus.tokens).max()) < 384
    # one EOS after each document
    assert int((np.asarray(corpus.tokens) == corpus.eos_id).sum()) == len(corpus_files)
    tok = load_tokenizer(corpus.tokenizer_dir)
    text = corpus_files[0].read_text()
    assert (
        tok.decode(list(corpus.tokens[:200])) == text[: len(tok.decode(list(corpus.tokens[:200])))]
    )
    # a second call reuses the cache: no tokenizing, same array
    again = prepare_corpus(cfg)
    assert sum("tokenizing the corpus" in m for m in caplog.messages) == 1
    assert np.array_equal(np.asarray(again.tokens), np.asarray(corpus.tokens))


@pytest.mark.unit
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
    # the entry holds its own copy of the tokenizer it was made with (a run copies it from there)
    assert corpus.tokenizer_dir != bpe.tokenizer_dir
    mine, theirs = load_tokenizer(corpus.tokenizer_dir), load_tokenizer(bpe.tokenizer_dir)
    assert mine.get_vocab() == theirs.get_vocab() and mine.eos_token == theirs.eos_token


@pytest.mark.unit
def test_missing_tokenizer_is_a_config_error(tmp_path, corpus_files):
    cfg = DataConfig(
        source="files",
        paths=[str(corpus_files[0])],
        tokenizer=str(tmp_path / "nope"),
        cache_dir=str(tmp_path),
    )
    with pytest.raises(ConfigError, match="data.tokenizer"):
        prepare_corpus(cfg)


@pytest.mark.unit
def test_missing_data_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="matches no file"):
        prepare_corpus(
            DataConfig(source="files", paths=[str(tmp_path / "none*.txt")], cache_dir=str(tmp_path))
        )


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def no_entries_left(cache: Path) -> bool:
    """Neither a cache entry nor its `.tmp-` build directory is under the cache root."""
    return not cache.exists() or not any(p.name.startswith("corpus-") for p in cache.iterdir())


@pytest.mark.unit
@pytest.mark.parametrize(
    "name, text, expected",
    [
        ("docs.jsonl/", "", "is a directory"),
        ("rows.jsonl", '{"text": "a"}\n{"body": "b"}\n', "line 2: no key 'text'"),
        ("rows.jsonl", '{"text": "a"}\n{"text": 3}\n', "line 2: 'text' is a number"),
        ("empty.jsonl", "", "holds no documents"),
    ],
)
def test_bad_data_is_a_config_error_and_leaves_no_cache_entry(tmp_path, name, text, expected):
    path = tmp_path / "data" / name
    path.mkdir(parents=True) if name.endswith("/") else write(path, text)
    cache = tmp_path / "cache"
    cfg = DataConfig(source="files", paths=[str(path)], vocab_size=260, cache_dir=str(cache))
    with pytest.raises(ConfigError) as e:
        prepare_corpus(cfg)
    assert f"'{path}'" in str(e.value) and expected in str(e.value)
    assert no_entries_left(cache)


@pytest.mark.unit
def test_skip_bad_rows_tokenizes_the_good_rows_and_records_the_count(
    tmp_path, corpus_files, caplog
):
    lines = corpus_files[0].read_text().split("\n\n")[:40]  # 40 paragraphs of a play
    good = [json.dumps({"text": t}) for t in lines]
    bad = ['{"id": 1}', '{"text": null}', '{"text": 12}']
    rows = write(tmp_path / "rows.jsonl", "\n".join(good[:10] + bad + good[10:]) + "\n")
    clean = write(tmp_path / "clean" / "rows.jsonl", "\n".join(good) + "\n")
    cache = tmp_path / "cache"
    cfg = DataConfig(source="files", paths=[str(rows)], vocab_size=300, cache_dir=str(cache))
    with pytest.raises(ConfigError, match=re.escape(f"'{rows}' line 11: no key 'text'")):
        prepare_corpus(cfg)
    caplog.set_level(logging.INFO, logger="bigtrain")
    corpus = prepare_corpus(replace(cfg, skip_bad_rows=True))
    reference = prepare_corpus(replace(cfg, paths=[str(clean)]))
    assert np.array_equal(np.asarray(corpus.tokens), np.asarray(reference.tokens))
    assert int((np.asarray(corpus.tokens) == corpus.eos_id).sum()) == 40
    assert corpus.skipped_rows == {str(rows.resolve()): 3}
    manifest = json.loads((cache / f"corpus-{corpus.key}" / "manifest.json").read_text())
    assert manifest["skipped_rows"] == {str(rows.resolve()): 3}
    assert reference.skipped_rows == {}
    # from the cache: the count again, and said again
    assert prepare_corpus(replace(cfg, skip_bad_rows=True)).skipped_rows == {str(rows.resolve()): 3}
    skipped = "3 rows without a string 'text' were skipped"
    assert sum(skipped in m for m in caplog.messages) == 2
    # the strict run still refuses the file: skip_bad_rows is part of the cache key
    with pytest.raises(ConfigError, match="line 11"):
        prepare_corpus(cfg)


@pytest.mark.e2e
def test_cli_names_a_directory_in_data_paths_and_exits_2(tmp_path):
    data = tmp_path / "data"
    write(data / "a.txt", "some text\n")
    result = run_cli(
        "train",
        "configs/tiny.yaml",
        "data.source=files",
        f"data.paths=[{data}]",
        f"train.out_dir={tmp_path / 'run'}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "wandb.mode=disabled",
        timeout=300,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().count("\n") == 0, result.stderr  # one line
    assert f"'{data}' is a directory" in result.stderr
    assert "Traceback" not in result.stderr
    assert no_entries_left(tmp_path / "cache")
    assert not (tmp_path / "run").exists()  # no partial run directory either
