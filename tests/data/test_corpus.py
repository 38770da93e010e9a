import dataclasses
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bigtrain.config.schema import DataConfig
from bigtrain.data.text.corpus import (
    Documents,
    expand_paths,
    shakespeare_files,
    strip_play_markup,
)
from bigtrain.errors import ConfigError

pytestmark = pytest.mark.unit


def test_strip_play_markup():
    md = "# Hamlet\n\n## ACT I\n\n_Enter HAMLET_\n\n**HAMLET**  \nTo be, or not to be:  \nthat is the question.\n"
    assert (
        strip_play_markup(md)
        == "Hamlet\n\nACT I\n\nEnter HAMLET\n\nHAMLET:\nTo be, or not to be:\nthat is the question.\n"
    )


def test_embedded_corpus_is_real_shakespeare():
    files = shakespeare_files()
    assert len(files) >= 36
    docs = Documents(DataConfig(source="shakespeare"))
    texts = list(docs)
    assert len(texts) == len(files)
    assert docs.bytes_read == docs.total_bytes == sum(f.stat().st_size for f in files)
    text = "\n".join(texts)
    assert len(text) > 4_000_000
    assert "To be, or not to be" in text
    assert "**" not in text and "\n#" not in text


def test_jsonl_and_text_files(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"body": "first doc"}\n{"body": "second doc"}\n')
    docs = Documents(DataConfig(source="files", paths=[str(tmp_path / "*.jsonl")], text_key="body"))
    assert list(docs) == ["first doc", "second doc"]
    (tmp_path / "b.txt").write_bytes(b"line one\r\nline two\n")  # newlines as datasets read them
    docs = Documents(DataConfig(source="files", paths=[str(tmp_path / "b.txt")]))
    assert list(docs) == ["line one\nline two\n"]


def files_cfg(*paths, **kwargs) -> DataConfig:
    return DataConfig(source="files", paths=[str(p) for p in paths], **kwargs)


@pytest.mark.parametrize("name", ["docs", "x.txt"])
def test_a_directory_in_paths_is_named_with_a_glob_to_use(tmp_path, name):
    (tmp_path / name).mkdir()
    (tmp_path / name / "a.txt").write_text("text\n")
    with pytest.raises(ConfigError) as e:
        Documents(files_cfg(tmp_path / name))
    assert f"'{tmp_path / name}' is a directory, expected a file" in str(e.value)
    assert f"'{tmp_path / name / '*.txt'}'" in str(e.value)


def test_a_dangling_symlink_names_the_missing_file(tmp_path):
    (tmp_path / "a.txt").symlink_to(tmp_path / "gone.txt")
    with pytest.raises(ConfigError) as e:
        expand_paths([str(tmp_path / "a.txt")])
    assert f"'{tmp_path / 'a.txt'}' is a symbolic link to '{tmp_path / 'gone.txt'}'" in str(e.value)
    assert "does not exist" in str(e.value)


def test_a_pattern_that_matches_only_directories_is_an_error(tmp_path):
    (tmp_path / "shard-1").mkdir()
    (tmp_path / "shard-2.txt").mkdir()
    with pytest.raises(ConfigError, match="matches only directories"):
        expand_paths([str(tmp_path / "shard-*")])
    (tmp_path / "shard-3.txt").write_text("text\n")  # a file beside them: the directories pass
    assert expand_paths([str(tmp_path / "shard-*")]) == [tmp_path / "shard-3.txt"]


def write_rows(path, rows: list[str]):
    path.write_text("".join(row + "\n" for row in rows))
    return path


GOOD = ['{"text": "first"}', '{"text": "second"}']


@pytest.mark.parametrize(
    "bad, problem",
    [
        ('{"body": "no text"}', "no key 'text' (keys: body)"),
        ('{"text": null}', "'text' is null"),
        ('{"text": 5}', "'text' is a number (5)"),
    ],
)
def test_a_bad_jsonl_row_names_file_line_and_key(tmp_path, bad, problem):
    good = write_rows(tmp_path / "good.jsonl", GOOD * 3)
    # line 4 of the second file: blank lines count, rows of other files do not
    bad_file = write_rows(tmp_path / "bad.jsonl", [GOOD[0], "", GOOD[1], bad, GOOD[0]])
    with pytest.raises(ConfigError) as e:
        list(Documents(files_cfg(good, bad_file)))
    assert str(e.value).startswith(f"data.paths: '{bad_file}' line 4: {problem};")
    assert "data.text_key='text'" in str(e.value)


def test_bad_rows_of_a_json_array_and_of_parquet_name_file_row_and_key(tmp_path):
    rows = tmp_path / "rows.json"
    rows.write_text('[{"body": "a"}, {"body": "b"}, {"body": 7}]')
    with pytest.raises(ConfigError, match=re.escape(f"'{rows}' row 3: 'body' is a number")):
        list(Documents(files_cfg(rows, text_key="body")))
    table = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"text": ["a", "b", None, "d"]}), table)
    with pytest.raises(ConfigError, match=re.escape(f"'{table}' row 3: 'text' is null")):
        list(Documents(files_cfg(table)))
    pq.write_table(pa.table({"text": [1, 2]}), table)
    with pytest.raises(ConfigError, match=re.escape(f"'{table}' row 1: 'text' holds int64 values")):
        list(Documents(files_cfg(table)))


def test_skip_bad_rows_keeps_the_good_rows_and_counts_the_others(tmp_path):
    good = write_rows(tmp_path / "good.jsonl", ['{"text": "a", "id": 1}', '{"text": "b", "id": 2}'])
    rows = ['{"text": "c", "id": 3}', '{"id": 4}', '{"text": 5, "id": 5}', '{"text": "d", "id": 6}']
    bad = write_rows(tmp_path / "bad.jsonl", [*rows, '{"text": null, "id": 7}'])
    docs = Documents(files_cfg(good, bad, skip_bad_rows=True))
    assert list(docs) == ["a", "b", "c", "d"]
    assert docs.skipped_rows == {str(bad.resolve()): 3}
    assert list(docs) == ["a", "b", "c", "d"]  # a second pass counts afresh
    assert docs.skipped_rows == {str(bad.resolve()): 3}
    table = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"text": ["a", None, "c"]}), table)
    docs = Documents(files_cfg(table, skip_bad_rows=True))
    assert list(docs) == ["a", "c"]
    assert docs.skipped_rows == {str(table.resolve()): 1}


def test_skip_bad_rows_still_refuses_a_file_without_a_good_row(tmp_path):
    good = write_rows(tmp_path / "good.jsonl", GOOD)
    wrong_key = write_rows(tmp_path / "wrong_key.jsonl", ['{"body": "a"}', '{"body": "b"}'])
    with pytest.raises(
        ConfigError, match=re.escape(f"'{wrong_key}' holds no documents: none of its 2 rows")
    ):
        list(Documents(files_cfg(good, wrong_key, skip_bad_rows=True)))


@pytest.mark.parametrize("name, content", [("a.jsonl", ""), ("a.jsonl", "\n\n"), ("a.txt", "")])
def test_an_empty_file_is_skipped_and_counted_or_an_error_when_asked(tmp_path, name, content):
    full = write_rows(tmp_path / ("full" + Path(name).suffix), ['{"text": "x"}'])
    empty = tmp_path / name
    empty.write_text(content)
    docs = Documents(files_cfg(full, empty))
    assert docs.files == [full] and docs.skipped_files["empty"] == [str(empty)]
    assert docs.skipped_summary()["empty"] == {"count": 1, "first": [str(empty)]}
    with pytest.raises(ConfigError) as e:
        Documents(files_cfg(empty))
    assert str(e.value) == (
        f"data.paths: '{empty}' holds no documents, nor does any other file of data.paths "
        "(1 empty, 0 binary)"
    )
    strict = dataclasses.replace(files_cfg(full, empty), skip_empty_files=False)
    with pytest.raises(ConfigError) as e:
        Documents(strict)
    assert str(e.value) == (
        f"data.paths: '{empty}' holds no documents (data.skip_empty_files=false)"
    )


def test_a_hub_dataset_is_streamed_and_its_rows_checked(monkeypatch):
    import datasets

    class Streamed:  # what load_dataset(..., streaming=True) returns, offline
        column_names = ["text", "id"]

        def __iter__(self):
            return iter([{"text": "a", "id": 1}, {"text": None, "id": 2}, {"text": "b", "id": 3}])

    calls = []
    monkeypatch.setattr(
        datasets, "load_dataset", lambda *a, **kw: calls.append((a, kw)) or Streamed()
    )
    cfg = DataConfig(source="hub", hub_name="org/web", split="train[:1%]")
    with pytest.raises(ConfigError, match="hub dataset 'org/web' row 2: 'text' is null"):
        list(Documents(cfg))
    assert calls[0] == (("org/web",), {"split": "train[:1%]", "streaming": True})
    docs = Documents(DataConfig(source="hub", hub_name="org/web", skip_bad_rows=True))
    assert list(docs) == ["a", "b"] and docs.skipped_rows == {"org/web": 1}
    with pytest.raises(ConfigError, match="has no column 'body' \\(data.text_key\\)"):
        list(Documents(DataConfig(source="hub", hub_name="org/web", text_key="body")))
