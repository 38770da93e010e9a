"""ZeRO fragments and FSDP2 shards as DCP chunks: the boxes of a flat range, and a save in one
layout loaded in another by DCP's own resharding (one process; tests/checkpoint/test_universal.py
does it across backends and world sizes)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from bigtrain.checkpoint.blocks import Blocks, boxes, range_views
from bigtrain.checkpoint.state import read, write

pytestmark = pytest.mark.unit

SHAPE = (6, 5, 3)


def covered(shape, found) -> torch.Tensor:
    mask = torch.zeros(shape, dtype=torch.int32)
    for offset, size in found:
        mask[tuple(slice(o, o + s) for o, s in zip(offset, size, strict=True))] += 1
    return mask.reshape(-1)


@pytest.mark.parametrize(
    ("shape", "start", "stop", "count"),
    [
        ((10,), 3, 7, 1),
        ((4, 4), 5, 6, 1),  # inside one row
        ((4, 4), 4, 12, 1),  # whole rows
        ((4, 4), 3, 13, 3),  # partial, whole, partial
        (SHAPE, 37, 90, 3),  # partial row of a 2-d row, then whole rows
        (SHAPE, 1, 89, 5),  # partial at both ends, in both inner dimensions
        ((), 0, 1, 1),
    ],
)
def test_boxes_cover_the_range_exactly_once_in_order(shape, start, stop, count):
    found = boxes(shape, start, stop)
    assert len(found) == count and len(found) <= 2 * max(len(shape) - 1, 0) + 1
    mask = covered(shape, found) if shape else torch.ones(1, dtype=torch.int32)
    expected = torch.zeros(math.prod(shape), dtype=torch.int32)
    expected[start:stop] = 1
    assert torch.equal(mask, expected)
    # in element order: the views of a flat range hold that range's values
    full = torch.arange(float(math.prod(shape))).view(shape)
    flat = full.reshape(-1)[start:stop].clone()
    for offset, view in range_views(shape, flat, start):
        index = tuple(slice(o, o + s) for o, s in zip(offset, view.shape, strict=True))
        assert torch.equal(view, full[index])


def test_a_tensor_saved_as_fragments_loads_as_row_shards_and_whole(tmp_path):
    full = torch.randn(SHAPE)
    cuts = [0, 37, 41, 90]  # three "ranks'" fragments, cut mid-row
    pieces = []
    for lo, hi in zip(cuts, cuts[1:], strict=False):
        pieces += range_views(SHAPE, full.reshape(-1)[lo:hi].clone(), lo)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the no-process-group warning is silenced, nothing else
        write(tmp_path, {"model.w": Blocks(SHAPE, pieces), "model.b": torch.ones(3)}, None)
        rows = [torch.zeros(2, 5, 3), torch.zeros(4, 5, 3)]
        read(
            tmp_path, {"model.w": Blocks(SHAPE, [((0, 0, 0), rows[0]), ((2, 0, 0), rows[1])])}, None
        )
        other = torch.zeros(53)
        read(tmp_path, {"model.w": Blocks(SHAPE, range_views(SHAPE, other, 37))}, None)
        whole, bias = torch.zeros(SHAPE), torch.zeros(3)
        read(tmp_path, {"model.w": whole, "model.b": bias}, None)
    assert torch.equal(torch.cat(rows), full)
    assert torch.equal(other, full.reshape(-1)[37:])
    assert torch.equal(whole, full) and torch.equal(bias, torch.ones(3))


def test_blocks_compute_nothing():
    blocks = Blocks(SHAPE, [((0, 0, 0), torch.zeros(SHAPE))])
    assert blocks.shape == SHAPE and blocks.dtype == torch.float32
    with pytest.raises(NotImplementedError, match="computes no"):
        blocks + 1


def test_a_partition_round_trips_with_its_moments_and_padding_left_at_zero(tmp_path):
    """ZeRO-like: one flat partition of 13 values holds w (2x3) then b (4), then 3 of padding.
    state_dict/write and load give back weights, moments and step; the padding's moments are 0."""
    from bigtrain.checkpoint.state import load, state_dict

    def blocks_of(index: int, flat: torch.Tensor):
        out = [("w", (2, 3), o, v) for o, v in range_views((2, 3), flat[:6], 0)]
        return out + [("b", (4,), o, v) for o, v in range_views((4,), flat[6:10], 0)]

    master = torch.arange(13.0)
    optim = {"step": 7.0, "exp_avg": master * 2, "exp_avg_sq": master * 3}
    write(tmp_path, state_dict(blocks_of, [master], [optim], {}), None)
    into = torch.full((13,), -1.0)
    shapes = {"w": (2, 3), "b": (4,)}
    ((step, moments),) = load(tmp_path, blocks_of, [into], {}, shapes, True, None)
    assert step == 7.0
    assert torch.equal(into[:10], master[:10]) and torch.equal(into[10:], torch.full((3,), -1.0))
    assert torch.equal(moments["exp_avg"][:10], master[:10] * 2)
    assert torch.equal(moments["exp_avg_sq"][10:], torch.zeros(3))  # padding: never garbage
    with pytest.raises(Exception, match=r"missing \['c'\]"):
        load(tmp_path, blocks_of, [into], {}, {**shapes, "c": (1,)}, True, None)
