"""PreparedData: slices across shards, the checks at open, the verification stamp."""

from __future__ import annotations

import json
import os
import pickle

import numpy as np
import pytest

from bigtrain.data.prepare.cache import TokenCorpus
from bigtrain.data.prepare.run import prepare
from bigtrain.data.prepare.summary import CorpusSummary
from bigtrain.data.read import prepared
from bigtrain.data.read.prepared import PreparedData
from bigtrain.data.read.stream import split_samples
from bigtrain.errors import ConfigError
from tests.data.conftest import expected_tokens, jsonl_cfg, write_jsonl
from tests.data.prepared_dirs import fake_tokenizer, random_documents, write_prepared

pytestmark = pytest.mark.unit

SUMMARY = CorpusSummary("files", ["tokens"], 1, 1001)  # what split_samples does not read


@pytest.fixture
def prepared_dir(tmp_path, paragraphs, tokenizer_dir):
    """200 documents in shards of about 1000 tokens; and their tokens as one array."""
    cfg = jsonl_cfg(write_jsonl(tmp_path / "docs.jsonl", paragraphs[:200]), tokenizer_dir)
    prepare(cfg, tmp_path / "corpus", shard_tokens=1000)
    return tmp_path / "corpus", expected_tokens(paragraphs[:200], tokenizer_dir)[0]


def test_slices_cross_shard_boundaries(prepared_dir):
    path, tokens = prepared_dir
    data = PreparedData.open(path)
    assert (data.name, data.path, data.tokenizer_dir) == ("corpus", path, path / "tokenizer")
    assert len(data) == data.num_tokens == len(tokens) and data.shape == (len(tokens),)
    assert data.dtype == np.uint16 and data.vocab_size == 300
    assert data.num_documents == 200 and len(data.shards) > 3
    ends = [s["num_tokens"] for s in data.shards]
    boundary = ends[0]
    rng = np.random.default_rng(0)
    cases = [(0, len(tokens)), (boundary - 3, boundary + 3), (boundary, boundary), (5, 2)]
    cases += [tuple(sorted(rng.integers(0, len(tokens), 2))) for _ in range(20)]
    for a, b in cases:
        assert np.array_equal(data[a:b], tokens[a:b]), (a, b)
    assert np.array_equal(data[-7:], tokens[-7:]) and np.array_equal(data[3:40:5], tokens[3:40:5])
    assert np.array_equal(data[::-1][:9], tokens[::-1][:9])
    assert int(data[boundary]) == tokens[boundary] and int(data[-1]) == tokens[-1] == data.eos_id
    with pytest.raises(IndexError):
        data[len(tokens)]
    assert np.array_equal(np.asarray(data), tokens)
    again = pickle.loads(pickle.dumps(data))
    assert np.array_equal(again[boundary - 1 : boundary + 1], tokens[boundary - 1 : boundary + 1])


def test_packed_samples_read_a_prepared_corpus(prepared_dir):
    path, tokens = prepared_dir
    data = PreparedData.open(path)
    from_disk = split_samples(TokenCorpus(data, 300, 0, "", "k", SUMMARY), 64, 0.1)
    in_memory = split_samples(
        TokenCorpus(tokens.astype(np.uint16), 300, 0, "", "k", SUMMARY), 64, 0.1
    )
    for a, b in zip(from_disk, in_memory, strict=True):
        assert len(a) == len(b)
        ids = list(range(len(a)))
        assert a.get(ids).equal(b.get(ids))


def test_a_corrupt_or_truncated_shard_is_refused_naming_the_file(prepared_dir, monkeypatch):
    path, _ = prepared_dir
    hashed = []
    monkeypatch.setattr(prepared, "file_sha256", lambda p: hashed.append(p.name) or "x")
    PreparedData.open(path)  # the writer stamped every file: nothing is hashed
    assert hashed == []
    monkeypatch.undo()
    shard = path / "shard_00002.bin"
    data = bytearray(shard.read_bytes())
    data[7] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=f"corrupt shard: file '{shard}'"):
        PreparedData.open(path)
    PreparedData.open(path, verify=False)  # sizes only
    shard.write_bytes(bytes(data[:-2]))
    with pytest.raises(ConfigError, match=f"corrupt shard: file '{shard}' has .* bytes"):
        PreparedData.open(path, verify=False)


def test_verification_is_stamped_and_redone_when_a_file_changes(prepared_dir, monkeypatch):
    path, _ = prepared_dir
    (path / ".verified.json").unlink()
    hashed = []
    real = prepared.file_sha256
    monkeypatch.setattr(prepared, "file_sha256", lambda p: hashed.append(p.name) or real(p))
    num_files = 2 * len(PreparedData.open(path).shards)
    assert len(hashed) == num_files
    PreparedData.open(path)
    assert len(hashed) == num_files  # stamped: not hashed again
    index = path / "shard_00001.idx"
    index.write_bytes(index.read_bytes())  # same bytes, a new mtime
    PreparedData.open(path)
    assert hashed[num_files:] == ["shard_00001.idx"]


def test_an_incomplete_or_foreign_directory_says_what_to_run(tmp_path, prepared_dir):
    with pytest.raises(ConfigError, match="has no manifest.json: .*`bigtrain prepare CONFIG --out"):
        PreparedData.open(tmp_path)
    (tmp_path / "progress.json").write_text("{}")
    with pytest.raises(ConfigError, match="is incomplete: .*to resume it"):
        PreparedData.open(tmp_path)
    with pytest.raises(ConfigError, match="is not a directory of prepared data"):
        PreparedData.open(tmp_path / "nothing")
    path, _ = prepared_dir
    manifest = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps({**manifest, "format": "other-2"}))
    with pytest.raises(ConfigError, match="format 'other-2', expected 'bigtrain-prepared-1'"):
        PreparedData.open(path)
    (path / "manifest.json").write_text(json.dumps(manifest))
    (path / "shard_00001.idx").unlink()
    with pytest.raises(ConfigError, match=f"missing shard: file '{path / 'shard_00001.idx'}'"):
        PreparedData.open(path)


def test_a_shard_changed_in_place_with_its_mtime_kept_is_hashed_again(prepared_dir):
    path, _ = prepared_dir
    PreparedData.open(path)
    shard = path / "shard_00001.bin"
    before = shard.stat()
    with shard.open("r+b") as f:  # ids far above the vocabulary of 300, in place
        f.seek(20)
        f.write(np.array([4000, 4001], "<u2").tobytes())
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = shard.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (
        before.st_size,
        before.st_mtime_ns,
        before.st_ino,
    )
    with pytest.raises(ConfigError, match=f"corrupt shard: file '{shard}'"):
        PreparedData.open(path)


def test_token_ids_beyond_the_vocabulary_name_the_shard(tmp_path):
    documents = random_documents(0, 3000, vocab_size=400)  # ids up to 399
    tokenizer = fake_tokenizer(tmp_path / "tok")
    fits = write_prepared(tmp_path / "fits", documents, tokenizer, vocab_size=400)
    PreparedData.open(fits)
    stamp = json.loads((fits / ".verified.json").read_text())
    for token_file in fits.glob("shard_*.bin"):  # each file's largest id, kept with its hash
        assert stamp[token_file.name]["max_token"] == int(np.fromfile(token_file, "<u2").max())
    path = write_prepared(tmp_path / "wide", documents, tokenizer, vocab_size=300)
    shard = path / "shard_00000.bin"
    largest = int(np.fromfile(shard, "<u2").max())
    with pytest.raises(ConfigError) as error:
        PreparedData.open(path)
    assert str(error.value) == (
        f"bad token ids: file '{shard}' holds token id {largest}, beyond the vocabulary of 300 "
        "ids (vocab_size in manifest.json): not ids of its tokenizer; prepare the corpus again"
    )
    with pytest.raises(ConfigError, match="bad token ids"):  # and not stamped as verified
        PreparedData.open(path)
