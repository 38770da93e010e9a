import numpy as np
import pytest
import torch

from bigtrain.data.prepare.cache import TokenCorpus
from bigtrain.data.prepare.summary import CorpusSummary
from bigtrain.data.read.stream import BatchLoader, PackedSamples, SampleStream, split_samples
from bigtrain.errors import ConfigError

pytestmark = pytest.mark.unit

SUMMARY = CorpusSummary("files", ["tokens"], 1, 1001)  # what split_samples does not read


def make_samples(n: int = 50, seq_len: int = 4) -> PackedSamples:
    tokens = np.arange(n * seq_len + 1, dtype=np.uint16)
    return PackedSamples(tokens, seq_len, 0, n)


def test_order_is_a_pure_function_of_seed_and_position():
    a, b = SampleStream(50, seed=1), SampleStream(50, seed=1)
    forward = [a.sample_at(g) for g in range(120)]
    backward = [b.sample_at(g) for g in reversed(range(120))][::-1]
    assert forward == backward
    assert sorted(forward[:50]) == list(range(50))  # each epoch is a permutation
    assert forward[:50] != forward[50:100]  # and epochs differ
    assert forward != [SampleStream(50, seed=2).sample_at(g) for g in range(120)]


def test_packing_targets_are_inputs_shifted():
    samples = make_samples()
    rows = samples.get([0, 3])
    assert rows.tolist() == [[0, 1, 2, 3, 4], [12, 13, 14, 15, 16]]


def test_split_has_no_overlap():
    corpus = TokenCorpus(np.arange(1001, dtype=np.uint16), 1000, 0, "", "k", SUMMARY)
    train, val = split_samples(corpus, 10, 0.1)
    assert (len(train), len(val)) == (90, 10)
    assert int(train.get([89])[0, -1]) == int(val.get([0])[0, 0]) == 900


def test_ranks_split_each_global_batch():
    samples = make_samples()
    one = BatchLoader(samples, SampleStream(50, 7), 4, 2, 0, 1, torch.device("cpu"))
    ranks = [
        BatchLoader(samples, SampleStream(50, 7), 4, 1, r, 2, torch.device("cpu")) for r in range(2)
    ]
    for _ in range(3):
        whole = torch.cat([x for x, _ in one.next_step()])
        parts = torch.cat([ranks[r].next_step()[0][0] for r in range(2)])
        assert torch.equal(whole, parts)
    assert one.stream.cursor == ranks[0].stream.cursor == ranks[1].stream.cursor == 24


def test_cursor_round_trip_continues_the_same_stream():
    samples = make_samples()
    a = BatchLoader(samples, SampleStream(50, 3), 4, 1, 0, 1, torch.device("cpu"))
    for _ in range(5):
        a.next_step()
    b = BatchLoader(samples, SampleStream(50, 3), 4, 1, 0, 1, torch.device("cpu"))
    b.stream.load_state_dict(a.stream.state_dict())
    assert torch.equal(a.next_step()[0][0], b.next_step()[0][0])


def test_skip_windows_are_never_read():
    stream = SampleStream(50, 3)
    stream.add_skip_window(4, 8)
    stream.add_skip_window(7, 10)  # overlapping windows merge
    stream.add_skip_window(12, 13)
    assert stream.skip_windows == [(4, 10), (12, 13)]
    positions = stream.take(8)
    assert positions == [0, 1, 2, 3, 10, 11, 13, 14]
    assert stream.cursor == 15
    state = stream.state_dict()
    restored = SampleStream(50, 3)
    restored.load_state_dict(state)
    assert restored.skip_windows == [(4, 10), (12, 13)] and restored.cursor == 15


def test_changed_corpus_or_seed_refuses_the_cursor():
    state = SampleStream(50, 3).state_dict()
    with pytest.raises(ConfigError, match="train.seed or the corpus changed"):
        SampleStream(51, 3).load_state_dict(state)


def test_read_ahead_serves_the_same_batches_and_drops_stale_ones():
    samples = make_samples()
    plain = BatchLoader(samples, SampleStream(50, 5), 4, 2, 0, 1, torch.device("cpu"))
    ahead = BatchLoader(samples, SampleStream(50, 5), 4, 2, 0, 1, torch.device("cpu"), prefetch=2)

    def step(loader):
        return torch.cat([torch.cat([x, y], 1) for x, y in loader.next_step()])

    for _ in range(3):
        assert torch.equal(step(plain), step(ahead))
    assert ahead.prefetch_hits == 2  # steps 2 and 3 came from the read-ahead
    # A rollback-style change of the stream: skip the positions that were read ahead, rewind.
    for loader in (plain, ahead):
        loader.stream.add_skip_window(24, 40)
    assert torch.equal(step(plain), step(ahead))
    assert ahead.prefetch_hits == 2  # the stale read was not used
    for loader in (plain, ahead):
        loader.stream.cursor = 8
    for _ in range(3):
        assert torch.equal(step(plain), step(ahead))
    assert ahead.prefetch_hits == 4
