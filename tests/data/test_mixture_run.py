"""Whole runs on data.source=prepared: tokens_by_source in metrics.jsonl, a source_exhausted event,
a resume that ends with the uninterrupted run's weights, and exit 2 for sources whose tokenizers
differ."""

from __future__ import annotations

from pathlib import Path

import pytest

from bigtrain.build import run
from bigtrain.errors import ConfigError
from bigtrain.parallel.env import DistEnv
from bigtrain.store.rundir import read_jsonl
from tests.conftest import run_cli
from tests.data.conftest import mixture_args
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
    with pytest.raises(ConfigError, match="different data.corpus_and_tokenizer"):
        run(micro(*reweighted, "train.max_steps=8", out="resumed"), ENV)


def test_sources_with_different_tokenizers_exit_2_naming_both(
    micro_args, mixture_sources, tmp_path
):
    other = write_prepared(
        tmp_path / "other", random_documents(7, 500), fake_tokenizer(tmp_path / "tok", "x")
    )
    args = micro_args(
        "data.source=prepared",
        f"data.mixture=[{mixture_sources['big']}, {other}]",
        "train.max_steps=2",
    )
    result = run_cli("train", *args)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"'{mixture_sources['big']}' and '{other}'" in result.stderr
    assert "different tokenizers" in result.stderr and "Traceback" not in result.stderr
