"""Whole runs on data.source=prepared: tokens_by_source in metrics.jsonl, a source_exhausted event,
a resume that ends with the uninterrupted run's weights, one message for a changed mixture on
resume, the corpus named at start, sources that share a tokenizer saved again, and exit 2 for
sources whose tokenizers differ or a shard with ids beyond the vocabulary."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from bigtrain.config.data import DataConfig
from bigtrain.data.prepare.run import prepare
from bigtrain.data.prepare.tokenizer import load_tokenizer, tokenizer_sha256
from bigtrain.data.read.prepared import PreparedData
from bigtrain.errors import ConfigError
from bigtrain.parallel.env import DistEnv
from bigtrain.runner import run
from bigtrain.store.rundir import read_jsonl
from tests.conftest import run_cli
from tests.data.conftest import mixture_args, write_jsonl
from tests.data.prepared_dirs import fake_tokenizer, random_documents, write_prepared

pytestmark = pytest.mark.e2e

ENV = DistEnv()


def test_a_mixture_run_logs_tokens_by_source_and_resumes_bit_exactly(micro, mixture_sources):
    straight = run(micro(*mixture_args(mixture_sources), out="straight"), ENV)
    out = Path(micro().train.out_dir).parent
    metrics = [m for m in read_jsonl(out / "straight" / "metrics.jsonl") if "loss" in m]
    assert [m["step"] for m in metrics] == [2, 4, 6]
    for m in metrics:
        assert set(m["tokens_by_source"]) == {"big", "small"}
        assert sum(m["tokens_by_source"].values()) == m["tokens"] == m["step"] * 256 * 8
    events = read_jsonl(out / "straight" / "events.jsonl")
    [exhausted] = [e for e in events if e["kind"] == "source_exhausted"]
    cap = exhausted["samples"]
    assert (exhausted["source"], exhausted["epochs"]) == ("small", 1.0)
    assert metrics[-1]["tokens_by_source"]["small"] == cap * 8  # every sample once, no more
    assert 1 < exhausted["step"] < 6

    stopped = run(micro(*mixture_args(mixture_sources), "train.stop_at_step=3", out="resumed"), ENV)
    assert stopped == {"step": 3, "stopped": True}
    resumed = run(micro(*mixture_args(mixture_sources), out="resumed"), ENV)
    assert resumed["fingerprint"] == straight["fingerprint"]
    assert resumed["loss"] == straight["loss"]
    again = [m for m in read_jsonl(out / "resumed" / "metrics.jsonl") if "loss" in m]
    assert again[-1]["tokens_by_source"] == metrics[-1]["tokens_by_source"]
    kinds = [e["kind"] for e in read_jsonl(out / "resumed" / "events.jsonl")]
    assert kinds.count("resume") == 1 and kinds.count("source_exhausted") == 1
    reweighted = [
        a.replace(
            f"{{path: {mixture_sources['big']}}}", f"{{path: {mixture_sources['big']}, weight: 2}}"
        )
        for a in mixture_args(mixture_sources)
    ]
    messages = []
    for allow in ("false", "true"):  # the flag cannot help: the message says so, either way
        with pytest.raises(ConfigError) as error:
            flag = f"checkpoint.allow_config_change={allow}"
            run(micro(*reweighted, "train.max_steps=8", flag, out="resumed"), ENV)
        messages.append(str(error.value))
    assert messages[0] == messages[1]
    assert "not even with checkpoint.allow_config_change=true" in messages[0]
    assert "set checkpoint.allow_config_change" not in messages[0]
    [start] = [e for e in read_jsonl(out / "straight" / "events.jsonl") if e["kind"] == "start"]
    sources = [PreparedData.open(mixture_sources[n]) for n in ("big", "small")]
    assert start["corpus"] == {
        "source": "prepared",
        "inputs": [str(mixture_sources["big"]), str(mixture_sources["small"])],
        "num_inputs": 2,
        "num_documents": sum(d.num_documents for d in sources),
        "num_tokens": sum(d.num_tokens for d in sources),
    }


def test_sources_with_different_tokenizers_exit_2_naming_both(
    micro_args, mixture_sources, tmp_path
):
    other = write_prepared(
        tmp_path / "other", random_documents(7, 500), fake_tokenizer(tmp_path / "tok", "x")
    )
    args = micro_args(
        "data.source=prepared",
        "data.paths=[]",
        f"data.mixture=[{mixture_sources['big']}, {other}]",
        "train.max_steps=2",
    )
    result = run_cli("train", *args)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"'{mixture_sources['big']}' and '{other}'" in result.stderr
    assert "different tokenizers" in result.stderr and "Traceback" not in result.stderr


def test_two_sources_share_one_tokenizer_saved_again(micro, paragraphs, tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    texts = write_jsonl(tmp_path / "a.jsonl", paragraphs[:300])
    prepare(DataConfig(source="files", paths=[str(texts)], vocab_size=300), first)
    texts = write_jsonl(tmp_path / "b.jsonl", paragraphs[300:])
    tokenizer = str(first / "tokenizer")
    prepare(DataConfig(source="files", paths=[str(texts)], tokenizer=tokenizer), second)
    assert tokenizer_sha256(first / "tokenizer") != tokenizer_sha256(second / "tokenizer")
    cfg = micro(
        "data.source=prepared",
        "data.paths=[]",
        f"data.mixture=[{first}, {second}]",
        "train.max_steps=2",
        "train.eval_every=2",
        "checkpoint.every=-1",
    )
    assert run(cfg, ENV)["step"] == 2
    sources = [PreparedData.open(path) for path in (first, second)]
    documents = sum(d.num_documents for d in sources)
    tokens = sum(d.num_tokens for d in sources)
    log = (Path(cfg.train.out_dir) / "logs" / "rank_0.log").read_text()
    assert (
        f"data: training on source=prepared, 2 prepared directories ({first}, {second}): "
        f"{documents:,} documents, {tokens:,} tokens"
    ) in log


def test_a_shard_edited_in_place_beyond_the_vocabulary_exits_2_naming_it(
    micro_args, mixture_sources, tmp_path
):
    tokenizer = mixture_sources["big"] / "tokenizer"
    vocab, eos = len(load_tokenizer(str(tokenizer))), load_tokenizer(str(tokenizer)).eos_token_id
    documents = random_documents(3, 3000, vocab_size=vocab, low=eos + 1)
    path = write_prepared(tmp_path / "edited", documents, tokenizer, eos_id=eos, vocab_size=vocab)
    PreparedData.open(path)  # verified and stamped
    shard = path / "shard_00001.bin"
    before = shard.stat()
    with shard.open("r+b") as f:  # every id of the shard: the first batch meets them
        f.write(np.full(before.st_size // 2, vocab + 1000, "<u2").tobytes())
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))
    args = micro_args(
        "data.source=prepared", "data.paths=[]", f"data.mixture=[{path}]", "train.max_steps=2"
    )
    result = run_cli("train", *args)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().count("\n") == 0 and "Traceback" not in result.stderr
    assert f"file '{shard}'" in result.stderr
