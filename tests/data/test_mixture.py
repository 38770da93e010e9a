"""Weighted mixtures of prepared directories (data/read/mixture.py, data/read/sources.py): the order
as a pure function of (seed, position), proportions, world sizes, skip windows and resume,
max_epochs, tokens_by_source, and the checks of the sources and the config keys."""

from __future__ import annotations

import json
import time
from collections import Counter

import numpy as np
import pytest
import torch

from bigtrain.callbacks.mixture_events import SourceEvents
from bigtrain.config import load_config
from bigtrain.config.data import DataConfig, MixtureSource
from bigtrain.data.prepare.tokenizer import (
    load_tokenizer,
    tokenizer_identity,
    tokenizer_sha256,
    train_bpe,
)
from bigtrain.data.read.mixture import MixedSamples, MixtureStream, SourceSpec
from bigtrain.data.read.prepared import PreparedData
from bigtrain.data.read.sources import build_mixture, check_length, open_mixture
from bigtrain.data.read.stream import BatchLoader, SampleStream
from bigtrain.errors import ConfigError
from bigtrain.plan.shapes import vocab_size_for_plan
from bigtrain.telemetry.sinks import flat_record
from tests.data.prepared_dirs import fake_tokenizer, random_documents, write_prepared
from tests.stubs import StubLoader, StubManager, StubTrainer, nonfinite, stub_healer

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")
WEIGHTS = {"web": 0.5, "code": 0.3, "books": 0.2}


def three_sources(**max_epochs: float) -> list[SourceSpec]:
    sizes = {"web": 5000, "code": 3000, "books": 2000}
    return [SourceSpec(n, sizes[n], w, max_epochs.get(n)) for n, w in WEIGHTS.items()]


def source_names(stream: MixtureStream, positions) -> list[str]:
    samples = MixedSamples([range(s.num_samples) for s in stream.specs], [])
    return [stream.specs[samples.source_of(stream.sample_at(p))[0]].name for p in positions]


def shares(names: list[str]) -> dict[str, float]:
    counts = Counter(names)
    return {n: counts[n] / len(names) for n in WEIGHTS}


@pytest.fixture
def prepared(tmp_path):
    """Three prepared directories with the same tokenizer: web (2 shards), code, books."""
    tok = fake_tokenizer(tmp_path / "tok")
    sizes = {"web": 3000, "code": 1500, "books": 800}
    return {
        name: write_prepared(tmp_path / name, random_documents(i, n), tok, shard_tokens=1200)
        for i, (name, n) in enumerate(sizes.items())
    }


def data_config(prepared, **overrides) -> DataConfig:
    mixture = [MixtureSource(str(prepared[n]), w) for n, w in WEIGHTS.items()]
    return DataConfig(source="prepared", mixture=mixture, **overrides)


def test_proportions_follow_the_weights_in_every_window():
    stream = MixtureStream(three_sources(), seed=5)
    names = source_names(stream, range(24_000))
    for name, share in shares(names[:4096]).items():
        assert abs(share - WEIGHTS[name]) < 0.02, (name, share)
    worst = max(
        abs(share - WEIGHTS[name])
        for start in range(0, len(names) - 3000, 250)
        for name, share in shares(names[start : start + 3000]).items()
    )
    assert worst < 0.02
    # at block boundaries each source is within one sample of its share
    for end in range(1024, 24_000, 1024):
        counts = Counter(names[:end])
        assert all(abs(counts[n] - end * w) <= 1 for n, w in WEIGHTS.items()), end


def test_order_is_a_pure_function_of_seed_and_position():
    a, b = MixtureStream(three_sources(), 1), MixtureStream(three_sources(), 1)
    forward = [a.sample_at(p) for p in range(5000)]
    assert [b.sample_at(p) for p in reversed(range(5000))][::-1] == forward
    assert forward != [MixtureStream(three_sources(), 2).sample_at(p) for p in range(5000)]
    # books' first 2000 draws are one epoch: each of its samples once
    books = [i - 8000 for i in (a.sample_at(p) for p in range(12_000)) if i >= 8000]
    assert sorted(books[:2000]) == list(range(2000)) and books[2000:4000] != books[:2000]
    fresh = MixtureStream(three_sources(), 1)
    started = time.perf_counter()
    fresh.sample_at(10**9)
    fresh.cursor = 1024 * 10**6  # a block boundary
    by_source = fresh.samples_by_source()
    assert time.perf_counter() - started < 1.0  # resuming far into a run replays nothing
    assert sum(by_source.values()) == fresh.cursor
    assert abs(by_source["code"] - 0.3 * fresh.cursor) <= 1


def test_every_world_size_sees_the_same_global_batches(prepared):
    mixture = build_mixture(data_config(prepared), *_opened(prepared), seq_len=16, seed=3)

    def loader(rank: int, world: int, prefetch: int) -> BatchLoader:
        stream = MixtureStream(mixture.stream.specs, 3)
        return BatchLoader(mixture.train, stream, 2, 8 // (2 * world), rank, world, CPU, prefetch)

    one = loader(0, 1, 0)
    many = {w: [loader(r, w, prefetch=1) for r in range(w)] for w in (2, 4)}
    for _ in range(6):
        whole = torch.cat([x for x, _ in one.next_step()])
        for loaders in many.values():
            parts = torch.cat([x for ld in loaders for x, _ in ld.next_step()])
            assert torch.equal(whole, parts)
    assert one.stream.cursor == many[4][3].stream.cursor == 48


def _opened(prepared, verify: bool = False):
    return [PreparedData.open(prepared[n], verify=verify) for n in WEIGHTS], []


def test_skip_windows_and_resume_continue_bit_exactly(prepared):
    cfg = data_config(prepared)
    first = build_mixture(cfg, *_opened(prepared), seq_len=16, seed=9)
    a = BatchLoader(first.train, first.stream, 4, 2, 0, 1, CPU, prefetch=2)
    for _ in range(3):
        a.next_step()
    a.stream.add_skip_window(30, 40)
    state = json.loads(json.dumps(a.stream.state_dict()))  # as a checkpoint manifest holds it
    expected = [a.next_step() for _ in range(3)]
    positions = a.stream.positions_from(24, 24)[0]
    assert positions[:6] == [24, 25, 26, 27, 28, 29] and positions[6] == 40
    second = open_mixture(cfg, seq_len=16, seed=9, is_main=True)  # verifies the shards
    b = BatchLoader(second.train, second.stream, 4, 2, 0, 1, CPU, prefetch=1)
    b.stream.load_state_dict(state)
    for want in expected:
        got = b.next_step()
        assert all(torch.equal(x, y) for (x, _), (y, _) in zip(want, got, strict=True))


def test_a_source_past_max_epochs_leaves_the_mixture(tmp_path):
    stream = MixtureStream(three_sources(code=2), seed=4)
    [(spec, end)] = stream.exhaustions()
    assert (spec.name, spec.cap) == ("code", 6000)
    ids = [stream.sample_at(p) for p in range(40_000)]
    code = Counter(i for i in ids if 5000 <= i < 8000)
    assert sum(code.values()) == 6000 and max(code.values()) == 2  # each sample twice at most
    last_code = max(p for p, i in enumerate(ids) if 5000 <= i < 8000)
    assert last_code + 1 == end
    after = source_names(stream, range(end + 1024, end + 1024 + 8192))
    assert abs(shares(after)["web"] - 0.5 / 0.7) < 0.02  # the others share code's weight
    assert shares(after)["code"] == 0
    # the event: once, in the step whose batch passes that position; not again after a resume
    trainer = StubTrainer(tmp_path / "run", [SourceEvents()])
    trainer.loader = StubLoader(stream, 1000)
    trainer.callbacks.on_start(trainer)
    for _ in range(25):
        trainer.step_end()
    [event] = trainer.events("source_exhausted")
    assert event["step"] == -(-end // 1000) and event["position"] == end
    assert (event["source"], event["epochs"], event["samples"]) == ("code", 2, 6000)


def test_running_past_every_exhausted_source_is_an_error_naming_them():
    stream = MixtureStream(
        [SourceSpec("web", 500, 1.0, 1.0), SourceSpec("code", 300, 3.0, 1.5)], seed=0
    )
    assert stream.end == 950  # every sample of web once, code's 450 draws
    assert len(stream.take(940)) == 940
    with pytest.raises(ConfigError, match="every source is exhausted.*web.*code"):
        stream.take(20)
    assert stream.cursor == 940  # nothing taken
    with pytest.raises(ConfigError, match=r"train.max_steps=10 needs 1000"):
        check_length(stream, 1000, max_steps=10)


def test_a_changed_mixture_refuses_the_checkpoint_cursor():
    state = MixtureStream(three_sources(), 3).state_dict()
    reweighted = [SourceSpec("web", 5000, 0.6), *three_sources()[1:]]
    with pytest.raises(ConfigError, match="mixture .* differs from this run's"):
        MixtureStream(reweighted, 3).load_state_dict(state)
    with pytest.raises(ConfigError, match="differs"):
        MixtureStream(three_sources(), 4).load_state_dict(state)
    with pytest.raises(ConfigError, match="trained on data.mixture"):
        SampleStream(10_000, 3).load_state_dict(state)
    with pytest.raises(ConfigError, match="trained on one corpus"):
        MixtureStream(three_sources(), 3).load_state_dict(SampleStream(10_000, 3).state_dict())


def test_tokens_by_source_leave_out_skip_windows_and_rolled_back_steps(tmp_path):
    stream = MixtureStream(three_sources(), 7)
    healer = stub_healer(StubManager(tmp_path), snapshot_every=2, confirm_steps=1)
    trainer = StubTrainer(tmp_path / "run", healer=healer, stream=stream, global_batch=300)
    healer.start(resumed=False)
    trainer.healthy(5)
    trainer.step_end(nonfinite(), skipped=True)  # step 6: back to step 4
    assert stream.cursor == 1200 and stream.skip_windows == [(1200, 1800)]
    trainer.healthy(4)
    taken = [p for p in range(stream.cursor) if not 1200 <= p < 1800]
    assert len(taken) == 8 * 300
    assert stream.samples_by_source() == dict(Counter(source_names(stream, taken)))
    stream.add_skip_window(2500, 99_999)  # a window past the cursor counts up to it
    assert sum(stream.samples_by_source().values()) == 8 * 300 - (stream.cursor - 2500)


def test_tokens_by_source_reach_wandb_by_source_name():
    record = flat_record({"step": 4, "tokens_by_source": {"web": 640, "code": 128}})
    assert record["data/tokens_by_source/web"] == 640
    assert record["data/tokens_by_source/code"] == 128


def test_validation_is_each_sources_tail_or_the_val_mixture(prepared, tmp_path):
    tails = build_mixture(data_config(prepared), *_opened(prepared), seq_len=16, seed=0)
    for train, val in zip(tails.train.parts, tails.val.samples.parts, strict=True):
        assert val.first == train.count and val.count >= 1  # no sample in both
    assert [s.num_samples for s in tails.stream.specs] == [p.count for p in tails.train.parts]
    val_names = Counter(source_names(tails.val.stream, range(1000)))
    assert abs(val_names["web"] / 1000 - 0.5) < 0.02  # validation mixed by the weights too
    held = write_prepared(
        tmp_path / "held", random_documents(9, 500), prepared["web"] / "tokenizer"
    )
    cfg = data_config(prepared, val_mixture=[MixtureSource(str(held))])
    whole = build_mixture(cfg, _opened(prepared)[0], [PreparedData.open(held)], 16, seed=0)
    assert [p.count for p in whole.train.parts] == [
        (len(PreparedData.open(prepared[n])) - 1) // 16 for n in WEIGHTS
    ]
    rows = whole.val.get(list(range(len(whole.val))))
    expected = PreparedData.open(held)[0 : len(whole.val) * 16 + 1]
    assert sorted(r[0].item() for r in rows) == sorted(expected[0:-1:16].tolist())


def test_sources_with_other_tokenizers_are_refused_naming_both(prepared, tmp_path):
    other = fake_tokenizer(tmp_path / "other-tok", tag="b")
    odd = write_prepared(tmp_path / "odd", random_documents(5, 500), other)
    cfg = data_config(prepared)
    cfg.mixture.append(MixtureSource(str(odd)))
    with pytest.raises(ConfigError, match=f"'{prepared['web']}' and '{odd}'.*different tokenizers"):
        open_mixture(cfg, seq_len=16, seed=0, is_main=True)
    eos = write_prepared(
        tmp_path / "eos", random_documents(5, 500), prepared["web"] / "tokenizer", eos_id=1
    )
    cfg.mixture[-1] = MixtureSource(str(eos))
    with pytest.raises(ConfigError, match="eos 0 vs .*eos 1"):
        open_mixture(cfg, seq_len=16, seed=0, is_main=True)


def test_a_tokenizer_is_its_vocabulary_merges_and_special_tokens_not_its_files(
    tmp_path, tokenizer_dir, paragraphs
):
    saved_again = tmp_path / "saved-again"
    load_tokenizer(str(tokenizer_dir)).save_pretrained(str(saved_again))
    other = tmp_path / "other"
    train_bpe(paragraphs[:100], 300, other)  # the same size, other merges
    assert tokenizer_sha256(saved_again) != tokenizer_sha256(tokenizer_dir)
    assert tokenizer_identity(saved_again) == tokenizer_identity(tokenizer_dir)
    assert tokenizer_identity(other) != tokenizer_identity(tokenizer_dir)
    documents = random_documents(0, 600, vocab_size=300)
    paths = {
        name: write_prepared(tmp_path / name, documents, tokenizer, vocab_size=300)
        for name, tokenizer in (("a", tokenizer_dir), ("b", saved_again), ("c", other))
    }
    same = DataConfig(source="prepared", mixture=[MixtureSource(str(paths[n])) for n in "ab"])
    assert open_mixture(same, seq_len=16, seed=0, is_main=True).vocab_size == 300
    differ = DataConfig(source="prepared", mixture=[MixtureSource(str(paths[n])) for n in "ac"])
    with pytest.raises(
        ConfigError, match=f"'{paths['a']}' and '{paths['c']}'.*different tokenizers"
    ):
        open_mixture(differ, seq_len=16, seed=0, is_main=True)


def test_prepared_reader_slices_across_shards_and_names_a_bad_file(prepared):
    data = PreparedData.open(prepared["web"])
    assert len(data.manifest["shards"]) == 3
    whole = np.concatenate(
        [np.fromfile(prepared["web"] / s["file"], dtype="<u2") for s in data.manifest["shards"]]
    )
    assert len(data) == len(whole) and data.name == "web"
    for start, stop in ((0, 17), (1190, 1290), (5, len(whole)), (len(whole) - 3, len(whole))):
        assert np.array_equal(data[start:stop], whole[start:stop])
    shard = prepared["web"] / "shard_00001.bin"
    shard.write_bytes(b"\x00\x00" + shard.read_bytes()[2:])
    with pytest.raises(ConfigError, match="shard_00001.bin"):
        PreparedData.open(prepared["web"], verify=True)
    shard.unlink()
    with pytest.raises(ConfigError, match="shard_00001.bin"):
        PreparedData.open(prepared["web"], verify=False)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.source=prepared"], "data.source=prepared needs 'data.mixture'"),
        (["data.mixture=[/a]"], "'data.mixture' is read only with data.source=prepared"),
        (["data.source=prepared", "data.mixture=[{path: /a, weight: 0}]"], "mixture\\[0\\].weight"),
        (["data.source=prepared", "data.mixture=[/a, /b, /a]"], "mixture\\[2\\].path' repeats"),
        (
            ["data.source=prepared", "data.mixture=[{path: /a, max_epochs: -1}]"],
            "mixture\\[0\\].max_epochs",
        ),
        (
            [
                "data.source=prepared",
                "data.mixture=[/a]",
                "data.val_mixture=[{path: /b, max_epochs: 1}]",
            ],
            "val_mixture\\[0\\].max_epochs' has no effect",
        ),
        (["data.source=prepared", "data.mixture=[{path: /a, wieght: 2}]"], "unknown key 'wieght'"),
    ],
)
def test_mixture_keys_are_checked_by_name(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config([], overrides)


def test_a_bare_path_is_an_entry_of_weight_one():
    cfg = load_config(
        [], ["data.source=prepared", "data.mixture=[/a, {path: /b, weight: 3, max_epochs: 2}]"]
    )
    assert cfg.data.mixture == [MixtureSource("/a"), MixtureSource("/b", 3.0, 2.0)]


def test_plan_reads_the_vocabulary_of_the_first_source(prepared):
    cfg = load_config([], ["data.source=prepared", f"data.mixture=[{prepared['code']}]"])
    assert (
        vocab_size_for_plan(cfg.model, cfg.data)
        == PreparedData.open(prepared["code"]).vocab_size
        == 256
    )


def test_the_corpus_key_follows_tokens_and_weights_not_manifest_notes(prepared, tmp_path):
    def key(cfg: DataConfig) -> str:
        return build_mixture(cfg, *_opened(prepared), seq_len=16, seed=0).key

    base = key(data_config(prepared))
    manifest = prepared["code"] / "manifest.json"
    notes = json.loads(manifest.read_text())
    notes["bigtrain_version"] = "9.9"
    manifest.write_text(json.dumps(notes))
    assert key(data_config(prepared)) == base
    reweighted = data_config(prepared)
    reweighted.mixture[0].weight = 0.6
    assert key(reweighted) != base != key(data_config(prepared, val_fraction=0.2))
