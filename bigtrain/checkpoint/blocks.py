"""Any rank's part of a parameter as blocks DCP can save and reshard.

DCP saves and loads a tensor as a set of chunks: boxes (offset, size) of the whole tensor. An
FSDP2 or tensor-parallel shard is one box. A ZeRO fragment is a range of the *flattened*
parameter, which is not a box, but is the union of at most 2(n-1)+1 boxes of an n-d tensor: a
partial row, whole rows, a partial row (`boxes`). `Blocks` is a tensor that only stands for
"these views are my boxes of a tensor of this shape" to DCP's planner (its `_Checkpointable`
protocol, as DTensor implements it), so every backend writes each parameter under one key and
shape, and DCP's own resharding loads any layout into any other.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offset, size)


def boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """The boxes whose union is elements [start, stop) of a row-major tensor of `shape`, in
    element order (so their volumes concatenated are that range)."""
    shape = tuple(shape)
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [((start,), (stop - start,))] if shape else [((), ())]
    row = math.prod(shape[1:])
    first, last = start // row, (stop - 1) // row
    if first == last:  # within one row: that row's boxes, one row thick
        inner = boxes(shape[1:], start - first * row, stop - first * row)
        return [((first, *o), (1, *s)) for o, s in inner]
    out: list[Box] = []
    if start % row:  # the tail of a first, partial row
        out += [((first, *o), (1, *s)) for o, s in boxes(shape[1:], start % row, row)]
        first += 1
    whole_end = stop // row
    if whole_end > first:
        out.append(((first, *[0] * (len(shape) - 1)), (whole_end - first, *shape[1:])))
    if stop % row:  # the head of a last, partial row
        out += [((whole_end, *o), (1, *s)) for o, s in boxes(shape[1:], 0, stop % row)]
    return out


def range_views(shape: Sequence[int], flat: torch.Tensor, start: int) -> list[tuple]:
    """(offset, view) pairs: `flat` holds elements [start, start + flat.numel()) of a tensor of
    `shape`; each view is a box of it, sharing flat's storage (a load writes into `flat`)."""
    out, at = [], 0
    for offset, size in boxes(shape, start, start + flat.numel()):
        n = math.prod(size)
        out.append((offset, flat[at : at + n].view(size)))
        at += n
    return out


class Blocks(torch.Tensor):
    """A tensor of `shape` of which this rank holds `pieces`, (offset, view) boxes. It computes
    nothing: DCP asks it for its chunks (save and load plans) and for the view at an offset
    (the data written, or the place a read lands)."""

    pieces: list[tuple[tuple[int, ...], torch.Tensor]]

    @staticmethod
    def __new__(cls, shape: Sequence[int], pieces: list[tuple[tuple[int, ...], torch.Tensor]]):
        first = pieces[0][1] if pieces else torch.empty(0)
        out = torch.Tensor._make_wrapper_subclass(
            cls, torch.Size(shape), dtype=first.dtype, device=first.device
        )
        out.pieces = pieces
        return out

    def __init__(self, shape, pieces) -> None:  # all done in __new__
        pass

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"Blocks stands for a checkpoint's chunks; it computes no {func}")

    def __repr__(self) -> str:  # type: ignore[override]
        return f"Blocks({list(self.shape)}, {[(o, tuple(t.shape)) for o, t in self.pieces]})"

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        properties = TensorProperties(dtype=self.dtype)
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(offset)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(offset), sizes=view.size()),
                    properties=properties,
                    size=self.size(),
                ),
            )
            for offset, view in self.pieces
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [
            ChunkStorageMetadata(offsets=torch.Size(offset), sizes=view.size())
            for offset, view in self.pieces
        ]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for offset, view in self.pieces:
            if torch.Size(offset) == index.offset:
                return view
        raise ValueError(f"no block of '{index.fqn}' at {index.offset}")
