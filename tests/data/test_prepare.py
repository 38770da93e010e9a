"""bigtrain prepare's writer: the shard format, resuming after a kill, bad rows, parquet, the CLI."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bigtrain.config.schema import DataConfig
from bigtrain.data.prepare import encode, shards
from bigtrain.data.prepare.cache import prepare_corpus
from bigtrain.data.prepare.run import prepare
from bigtrain.data.prepare.tokenizer import tokenizer_sha256
from bigtrain.data.read.prepared import PreparedData
from bigtrain.data.text import rows
from bigtrain.errors import ConfigError
from bigtrain.utils.files import sha256_file
from tests.conftest import ROOT, run_cli
from tests.data.conftest import expected_tokens, jsonl_cfg, write_jsonl

SHARD_TOKENS = 4000  # the test play's ~600 paragraphs make about 8 shards


def shard_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("shard_*"))}


@pytest.mark.unit
@pytest.mark.parametrize("num_proc", [1, 2])
def test_shards_hold_the_tokenizers_ids_with_eos_after_each_document(
    tmp_path, paragraphs, tokenizer_dir, monkeypatch, num_proc
):
    monkeypatch.setattr(encode, "BATCH_DOCS", 50)  # several batches, so the pool has work
    path = write_jsonl(tmp_path / "docs.jsonl", paragraphs)
    cfg = jsonl_cfg(path, tokenizer_dir, num_proc=num_proc)
    manifest = prepare(cfg, tmp_path / "out", shard_tokens=SHARD_TOKENS)
    tokens, lengths = expected_tokens(paragraphs, tokenizer_dir)
    out = tmp_path / "out"
    assert manifest["format"] == "bigtrain-prepared-1" and manifest["dtype"] == "uint16"
    assert (manifest["num_documents"], manifest["num_tokens"]) == (len(paragraphs), len(tokens))
    assert (manifest["vocab_size"], manifest["skipped_rows"]) == (300, {})
    assert manifest["tokenizer"] == {
        "dir": "tokenizer",
        "sha256": tokenizer_sha256(out / "tokenizer"),
    }
    assert manifest["source"]["paths"] == [str(path)] and manifest["source"]["tokenizer"] == str(
        tokenizer_dir
    )
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["manifest.json", ".verified.json", "tokenizer", "inputs.txt"]
        + [s[k] for s in manifest["shards"] for k in ("file", "index")]
    )  # the progress file went once the manifest was written
    assert len(manifest["shards"]) >= 4
    first = 0
    for number, shard in enumerate(manifest["shards"]):
        assert (shard["file"], shard["index"]) == shards.shard_files(number)
        bin_bytes, idx_bytes = (
            (out / shard["file"]).read_bytes(),
            (out / shard["index"]).read_bytes(),
        )
        assert sha256_file(out / shard["file"]) == shard["sha256"]
        assert sha256_file(out / shard["index"]) == shard["index_sha256"]
        ids = np.frombuffer(bin_bytes, "<u2")
        ends = np.frombuffer(idx_bytes, "<u8")
        docs = lengths[first : first + shard["num_documents"]]
        assert shard["first_document"] == first
        assert ends.tolist() == np.cumsum(docs).tolist()  # whole documents, EOS included
        start = int(lengths[:first].sum())
        assert ids.tolist() == tokens[start : start + len(ids)].tolist()
        if number < len(manifest["shards"]) - 1:  # closed by the document that filled it
            assert shard["num_tokens"] >= SHARD_TOKENS > shard["num_tokens"] - docs[-1]
        first += shard["num_documents"]
    data = PreparedData.open(out)
    assert np.array_equal(data[:], tokens)
    assert data.document_ends().tolist() == np.cumsum(lengths).tolist()


@pytest.mark.unit
def test_the_token_cache_is_the_same_writer_with_a_trained_bpe(tmp_path, corpus_files):
    cfg = DataConfig(
        source="files",
        paths=[str(p) for p in corpus_files],
        vocab_size=300,
        cache_dir=str(tmp_path / "cache"),
    )
    manifest = prepare(cfg, tmp_path / "out", shard_tokens=50_000)
    corpus = prepare_corpus(cfg)
    texts = [p.read_text() for p in corpus_files]
    tokens, _ = expected_tokens(texts, tmp_path / "out" / "tokenizer")
    assert np.array_equal(PreparedData.open(tmp_path / "out")[:], tokens)
    assert np.array_equal(corpus.tokens[:], tokens)  # the BPE is trained the same way
    assert len(corpus) == manifest["num_tokens"] and len(manifest["shards"]) == 2  # a play each
    assert corpus.tokens.manifest["tokenizer"] == manifest["tokenizer"]


KILL_IN_SECOND_SHARD = """
import json, os, signal, sys
from bigtrain.config.schema import DataConfig
from bigtrain.data.prepare import shards
from bigtrain.data.prepare.run import prepare

write = shards._OpenShard.write

def write_then_die(self, tokens, lengths):
    write(self, tokens, lengths)
    if self.file != "shard_00000.bin":  # shard 0 is finished and recorded: die in shard 1
        os.kill(os.getpid(), signal.SIGKILL)

shards._OpenShard.write = write_then_die
prepare(DataConfig(**json.loads(sys.argv[1])), sys.argv[2], shard_tokens=int(sys.argv[3]))
"""


@pytest.mark.e2e
def test_a_killed_prepare_resumes_to_byte_identical_shards(tmp_path, paragraphs, tokenizer_dir):
    cfg = jsonl_cfg(write_jsonl(tmp_path / "docs.jsonl", paragraphs), tokenizer_dir)
    reference = prepare(cfg, tmp_path / "whole", shard_tokens=SHARD_TOKENS)
    out = tmp_path / "killed"
    args = [json.dumps(cfg.__dict__), str(out), str(SHARD_TOKENS)]
    killed = subprocess.run(
        [sys.executable, "-c", KILL_IN_SECOND_SHARD, *args], cwd=ROOT, capture_output=True
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()[-2000:]
    progress = json.loads((out / "progress.json").read_text())
    assert [s["file"] for s in progress["shards"]] == ["shard_00000.bin"]
    assert (out / "shard_00001.bin").exists() and not (out / "manifest.json").exists()
    with pytest.raises(ConfigError, match="is incomplete.*run the same `bigtrain prepare`"):
        PreparedData.open(out)
    kept = (out / "shard_00000.bin").stat().st_mtime_ns
    resumed = prepare(replace(cfg, num_proc=2), out, shard_tokens=SHARD_TOKENS)
    assert resumed == reference
    assert shard_bytes(out) == shard_bytes(tmp_path / "whole")
    assert (out / "shard_00000.bin").stat().st_mtime_ns == kept  # not written again


@pytest.mark.unit
def test_resume_redoes_a_damaged_shard_and_starts_over_for_changed_input(
    tmp_path, paragraphs, tokenizer_dir, monkeypatch
):
    cfg = jsonl_cfg(write_jsonl(tmp_path / "docs.jsonl", paragraphs), tokenizer_dir)
    prepare(cfg, tmp_path / "whole", shard_tokens=SHARD_TOKENS)
    out = tmp_path / "out"
    write = shards._OpenShard.write

    def write_then_stop(self, tokens, lengths):
        write(self, tokens, lengths)
        if self.file == "shard_00003.bin":
            raise KeyboardInterrupt

    monkeypatch.setattr(shards._OpenShard, "write", write_then_stop)
    with pytest.raises(KeyboardInterrupt):
        prepare(cfg, out, shard_tokens=SHARD_TOKENS)
    monkeypatch.undo()
    assert len(json.loads((out / "progress.json").read_text())["shards"]) == 3
    with (out / "shard_00001.bin").open("r+b") as f:  # damage the second of three kept shards
        f.seek(10)
        byte = f.read(1)
        f.seek(10)
        f.write(bytes([byte[0] ^ 1]))
    stamp = (out / "shard_00000.bin").stat().st_mtime_ns
    prepare(cfg, out, shard_tokens=SHARD_TOKENS)
    assert shard_bytes(out) == shard_bytes(tmp_path / "whole")
    assert (out / "shard_00000.bin").stat().st_mtime_ns == stamp  # kept; 1 and on redone
    # changed input: the progress file no longer applies, everything is redone
    other = write_jsonl(tmp_path / "other.jsonl", paragraphs[:100])
    with pytest.raises(KeyboardInterrupt):
        monkeypatch.setattr(shards._OpenShard, "write", write_then_stop)
        prepare(cfg, tmp_path / "again", shard_tokens=SHARD_TOKENS)
    monkeypatch.undo()
    manifest = prepare(replace(cfg, paths=[str(other)]), tmp_path / "again", shard_tokens=100_000)
    tokens, _ = expected_tokens(paragraphs[:100], tokenizer_dir)
    assert np.array_equal(PreparedData.open(tmp_path / "again")[:], tokens)
    assert [s["file"] for s in manifest["shards"]] == ["shard_00000.bin"]
    assert not list((tmp_path / "again").glob("shard_00001.*"))


@pytest.mark.unit
def test_bad_rows_are_named_or_skipped_and_counted(tmp_path, paragraphs, tokenizer_dir):
    good = [json.dumps({"text": t}) for t in paragraphs[:30]]
    bad = ['{"id": 1}', '{"text": null}', '{"text": 12}']
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(good[:10] + bad + good[10:]) + "\n")
    cfg = jsonl_cfg(path, tokenizer_dir)
    with pytest.raises(ConfigError, match=re.escape(f"'{path}' line 11: no key 'text'")):
        prepare(cfg, tmp_path / "strict")
    manifest = prepare(replace(cfg, skip_bad_rows=True), tmp_path / "out")
    assert manifest["skipped_rows"] == {str(path.resolve()): 3}
    assert manifest["source"]["skip_bad_rows"] is True
    assert manifest["num_documents"] == 30
    tokens, _ = expected_tokens(paragraphs[:30], tokenizer_dir)
    assert np.array_equal(PreparedData.open(tmp_path / "out")[:], tokens)


@pytest.mark.unit
def test_parquet_is_read_in_batches_and_nulls_are_bad_rows(
    tmp_path, paragraphs, tokenizer_dir, monkeypatch
):
    monkeypatch.setattr(rows, "PARQUET_BATCH_ROWS", 4)
    texts = paragraphs[:20]
    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"body": texts[:9] + [None] + texts[9:]}), path)
    cfg = DataConfig(
        source="files", paths=[str(path)], text_key="body", tokenizer=str(tokenizer_dir)
    )
    with pytest.raises(ConfigError, match=re.escape(f"'{path}' row 10: 'body' is null")):
        prepare(cfg, tmp_path / "strict")
    manifest = prepare(replace(cfg, skip_bad_rows=True), tmp_path / "out", shard_tokens=500)
    assert manifest["skipped_rows"] == {str(path.resolve()): 1}
    tokens, _ = expected_tokens(texts, tokenizer_dir)
    assert np.array_equal(PreparedData.open(tmp_path / "out")[:], tokens)


@pytest.mark.unit
def test_the_output_directory_must_be_new_empty_or_a_prepare_to_resume(
    tmp_path, paragraphs, tokenizer_dir
):
    cfg = jsonl_cfg(write_jsonl(tmp_path / "docs.jsonl", paragraphs[:5]), tokenizer_dir)
    prepare(cfg, tmp_path / "out")
    with pytest.raises(ConfigError, match="already holds a prepared corpus"):
        prepare(cfg, tmp_path / "out")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="did not write \\(such as 'notes.txt'\\)"):
        prepare(cfg, tmp_path / "mine")
    with pytest.raises(ConfigError, match="matches no file"):  # nothing made for bad input
        prepare(replace(cfg, paths=[str(tmp_path / "none.jsonl")]), tmp_path / "new")
    assert not (tmp_path / "new").exists()


@pytest.mark.e2e
def test_cli_prepare_prints_a_summary_and_exits_2_on_bad_input(tmp_path, paragraphs, tokenizer_dir):
    path = write_jsonl(tmp_path / "docs.jsonl", paragraphs[:50])
    common = ["data.source=files", f"data.paths=[{path}]", f"data.tokenizer={tokenizer_dir}"]
    done = run_cli("prepare", *common, "--out", str(tmp_path / "out"), timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["num_documents"] == 50 and summary["num_shards"] == 1
    assert (summary["source"], summary["first_inputs"]) == ("files", [str(path)])
    assert summary["num_inputs"] == 1 and summary["skipped_files"] == {"empty": 0, "binary": 0}
    assert Path(summary["inputs_list"]).read_text() == f"{path}\n"
    read = f"prepare: read source=files, 1 file ({path}): 50 documents, {summary['num_tokens']:,}"
    assert read in done.stdout
    assert summary["num_tokens"] == len(PreparedData.open(tmp_path / "out"))
    path.write_text(path.read_text() + '{"text": 7}\n')
    bad = run_cli("prepare", *common, "--out", str(tmp_path / "bad"), timeout=300)
    assert bad.returncode == 2
    assert bad.stderr.strip().count("\n") == 0 and "Traceback" not in bad.stderr
    assert f"'{path}' line 51: 'text' is a number" in bad.stderr


@pytest.mark.unit
def test_a_failed_prepare_removes_only_the_directory_it_made(tmp_path, paragraphs, tokenizer_dir):
    cfg = jsonl_cfg(write_jsonl(tmp_path / "docs.jsonl", paragraphs[:20]), tokenizer_dir)
    missing = replace(cfg, tokenizer=str(tmp_path / "no-tokenizer"))
    with pytest.raises(ConfigError, match="data.tokenizer: cannot load"):
        prepare(missing, tmp_path / "new" / "out")
    assert not (tmp_path / "new").exists()  # the parent it made goes too
    (tmp_path / "mine").mkdir()
    with pytest.raises(ConfigError, match="data.tokenizer: cannot load"):
        prepare(missing, tmp_path / "mine")
    assert (tmp_path / "mine").is_dir()  # the user's own directory stays
    bad = write_jsonl(tmp_path / "bad.jsonl", paragraphs[:5])
    bad.write_text(bad.read_text() + '{"text": 7}\n')
    with pytest.raises(ConfigError, match="line 6: 'text' is a number"):
        prepare(replace(cfg, paths=[str(bad)]), tmp_path / "rows")  # after its tokenizer
    assert not (tmp_path / "rows").exists()


@pytest.mark.unit
def test_a_prepared_directory_as_data_tokenizer_names_its_tokenizer(
    tmp_path, paragraphs, tokenizer_dir
):
    cfg = jsonl_cfg(write_jsonl(tmp_path / "docs.jsonl", paragraphs[:5]), tokenizer_dir)
    prepare(cfg, tmp_path / "first")
    with pytest.raises(ConfigError) as error:
        prepare(replace(cfg, tokenizer=str(tmp_path / "first")), tmp_path / "second")
    assert str(error.value) == (
        f"data.tokenizer: '{tmp_path / 'first'}' is a prepared corpus or a run directory, not a "
        f"tokenizer; use data.tokenizer={tmp_path / 'first' / 'tokenizer'}"
    )
    assert not (tmp_path / "second").exists()


@pytest.mark.e2e
def test_cli_prepare_refuses_paths_without_source_files(tmp_path, paragraphs):
    path = write_jsonl(tmp_path / "docs.jsonl", paragraphs[:5])
    result = run_cli("prepare", f"data.paths=[{path}]", "--out", str(tmp_path / "out"))
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().count("\n") == 0 and "Traceback" not in result.stderr
    assert "key 'data.paths' is set, but data.source is 'shakespeare'" in result.stderr
    assert not (tmp_path / "out").exists()


def code_tree(root: Path) -> dict[str, Path]:
    """A small repository: Python sources, an extension-less licence, an empty __init__.py, a
    binary file with a NUL byte and one that is not UTF-8."""
    (root / "pkg").mkdir(parents=True)
    files = {
        "main": root / "pkg" / "main.py",
        "util": root / "pkg" / "util.py",
        "init": root / "pkg" / "__init__.py",
        "licence": root / "LICENSE",
        "blob": root / "pkg" / "data.bin",
        "latin1": root / "pkg" / "old.py",
    }
    files["main"].write_text("def main():\n    return 42\n" * 30)
    files["util"].write_text("import os\n\ndef here():\n    return os.getcwd()\n" * 20)
    files["init"].write_text("")
    files["licence"].write_text("Permission is hereby granted, free of charge.\n" * 10)
    files["blob"].write_bytes(b"\x7fELF\x00\x01binary")
    files["latin1"].write_bytes("caf\xe9 = 1\n".encode("latin-1"))
    return files


@pytest.mark.unit
def test_a_code_corpus_reads_text_by_content_and_counts_what_it_skips(tmp_path, tokenizer_dir):
    """Code and extension-less text files are documents; binary files (a NUL byte, or not
    UTF-8) and empty files are skipped and counted in the manifest, not an error."""
    files = code_tree(tmp_path / "repo")
    cfg = DataConfig(source="files", paths=[str(tmp_path / "repo" / "**" / "*")])
    cfg = replace(cfg, tokenizer=str(tokenizer_dir))
    manifest = prepare(cfg, tmp_path / "out", progress=False)
    assert manifest["num_documents"] == 3 and manifest["num_inputs"] == 3
    read = (tmp_path / "out" / manifest["inputs"]).read_text().splitlines()
    assert sorted(read) == sorted(str(files[k]) for k in ("main", "util", "licence"))
    skipped = manifest["skipped_files"]
    assert skipped["empty"] == {"count": 1, "first": [str(files["init"])]}
    assert skipped["binary"]["count"] == 2
    assert sorted(skipped["binary"]["first"]) == sorted([str(files["blob"]), str(files["latin1"])])
    with pytest.raises(ConfigError, match=r"__init__.py' holds no documents \(data.skip_empty"):
        prepare(replace(cfg, skip_empty_files=False), tmp_path / "strict", progress=False)


@pytest.mark.unit
def test_text_and_row_files_are_not_mixed_and_a_txt_file_must_be_utf8(tmp_path, tokenizer_dir):
    (tmp_path / "a.py").write_text("x = 1\n")
    rows = write_jsonl(tmp_path / "b.jsonl", ["one", "two"])
    cfg = DataConfig(source="files", paths=[str(tmp_path / "a.py"), str(rows)])
    with pytest.raises(
        ConfigError, match=r"mixes formats \['json', 'text'\] \(such as '.*b.jsonl'"
    ):
        prepare(replace(cfg, tokenizer=str(tokenizer_dir)), tmp_path / "out", progress=False)
    bad = tmp_path / "notes.txt"  # named text: an encoding error is the user's to know
    bad.write_bytes("caf\xe9\n".encode("latin-1"))
    cfg = DataConfig(source="files", paths=[str(bad)], tokenizer=str(tokenizer_dir))
    with pytest.raises(ConfigError, match="notes.txt' is not UTF-8 text"):
        prepare(cfg, tmp_path / "out2", progress=False)


@pytest.mark.e2e
def test_a_python_corpus_prepares_and_trains(tmp_path, cache_dir):
    """The issue's case: `data.paths=[.../*.py]` with an empty __init__.py prepares, and a run
    trains on it."""
    code_tree(tmp_path / "repo")
    for i in range(40):  # enough tokens for a few steps of the micro model
        (tmp_path / "repo" / "pkg" / f"mod{i}.py").write_text(
            f"def f{i}(x):\n    return x * {i}\n" * 40
        )
    out = tmp_path / "prepared"
    pattern = str(tmp_path / "repo" / "**" / "*.py")
    done = run_cli(
        "prepare",
        "data.source=files",
        f"data.paths=[{pattern}]",
        "data.vocab_size=300",
        "--out",
        str(out),
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["skipped_files"] == {"empty": 1, "binary": 1}  # __init__.py, old.py
    assert summary["num_inputs"] == 42 and len(summary["first_inputs"]) == 5
    trained = run_cli(
        "train",
        "configs/tiny.yaml",
        "data.source=prepared",
        f"data.mixture=[{out}]",
        f"train.out_dir={tmp_path / 'run'}",
        "train.max_steps=3",
        "train.micro_batch_size=2",
        "model.seq_len=32",
        "train.eval_every=0",
        "checkpoint.every=-1",
        "wandb.mode=disabled",
        "data.val_fraction=0.1",
    )
    assert trained.returncode == 0, trained.stderr[-2000:]
    assert json.loads((tmp_path / "run" / "final.json").read_text())["step"] == 3
