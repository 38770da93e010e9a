"""The one on-disk form of a run's model and optimizer state, for every backend.

A checkpoint's tensors are a torch.distributed.checkpoint (DCP) directory `dcp/` with these keys,
whatever backend, world size or mesh wrote it:

    model.<name>              FP32 master weight, whole shape, canonical name (utils/names.py);
                              the model's persistent buffers too, in their own dtype
    optim.<name>.exp_avg      AdamW's moments in FP32 (low-precision states are decoded),
    optim.<name>.exp_avg_sq   the parameter's shape
    optim.<name>.step         float64 scalar: the parameter's optimizer step count

Each rank writes the blocks of each parameter it holds (`Block`: an FSDP2/tensor-parallel shard
is one, a ZeRO fragment at most three per dimension, checkpoint/blocks.py), so a save never
gathers; a load asks for the blocks it holds now, and DCP's resharding reads them from whatever
chunks were saved. The optim keys are absent for a parameter without optimizer state (before its
first step). `CheckpointReader` reads whole tensors without a process group (export, generate,
convert).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from bigtrain.checkpoint.blocks import Blocks
from bigtrain.checkpoint.sources import Source, check_covers
from bigtrain.checkpoint.storage import ChunkPlanner, ChunkReader, HashingFileSystem
from bigtrain.optim.optimizer import MOMENTS

DIR = "dcp"
Block = tuple[str, tuple[int, ...], tuple[int, ...], torch.Tensor]
"""(canonical name, the parameter's whole shape, the block's offset in it, a view of the block)."""
BlocksOf = Callable[[int, torch.Tensor], list[Block]]
"""A backend's map from its i-th master tensor (or a tensor shaped like it: a host copy, a
moment) to the parameter blocks it holds."""
NO_DIST_WARNING = "torch.distributed is disabled, unavailable or uninitialized"
"""The start of the UserWarning DCP gives on every save or load without a process group."""


def state_dict(
    blocks_of: BlocksOf,
    masters: list[torch.Tensor],
    optim: list[dict[str, Any] | None],
    buffers: dict[str, torch.Tensor],
) -> dict[str, Any]:
    """The state dict this rank saves: `masters` (FP32, host copies or live), `optim` per master
    its FP32 state (step and moments; None without state), `buffers` by canonical name."""
    grouped: dict[str, tuple[tuple[int, ...], list]] = {}
    out: dict[str, Any] = {}
    for i, master in enumerate(masters):
        state = optim[i]
        tensors = {"model": master} | ({k: state[k] for k in MOMENTS} if state else {})
        for part, tensor in tensors.items():
            for name, shape, offset, view in blocks_of(i, tensor):
                if not view.numel():
                    continue
                key = f"model.{name}" if part == "model" else f"optim.{name}.{part}"
                grouped.setdefault(key, (shape, []))[1].append((offset, view))
                if state:
                    out[f"optim.{name}.step"] = torch.tensor(
                        float(state["step"]), dtype=torch.float64
                    )
    out.update({key: Blocks(shape, pieces) for key, (shape, pieces) in grouped.items()})
    out.update({f"model.{name}": value for name, value in buffers.items()})
    return out


def write(
    directory: Path, state: dict[str, Any], group: dist.ProcessGroup | None, threads: int = 1
) -> dict[str, str]:
    """Save `state` under directory/dcp (a collective over `group`; None: this process alone) with
    `threads` writer threads; the files this rank wrote, relative to `directory`, with the sha256
    of the bytes written (hashed on the way to the file, so nothing is read back)."""
    # No fsync here: the manager fsyncs every file this rank wrote (checkpoint/manifest.py).
    # `threads`: DCP's writer threads, each with a file of its own (a synchronous save, which the
    # loop waits for, uses several; a background one keeps to one beside training).
    writer = FileSystemWriter(directory / DIR, sync_files=False, thread_count=threads)
    writer.fs = fs = HashingFileSystem()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", NO_DIST_WARNING, UserWarning)
        dcp.save(state, storage_writer=writer, process_group=group, no_dist=group is None)
    names = files_of_rank(directory, dist.get_rank(group) if group is not None else 0)
    missing = [n for n in names if n[len(DIR) + 1 :] not in fs.sha256]
    if missing:
        raise RuntimeError(f"DCP wrote {missing} past bigtrain's hashing file system")
    return {n: fs.sha256[n[len(DIR) + 1 :]] for n in names}


def read(
    directory: Path,
    state: dict[str, Any],
    group: dist.ProcessGroup | None,
    reader: ChunkReader | None = None,
) -> None:
    """Load directory/dcp into `state`'s tensors and blocks, in place (a collective over
    `group`; None: this process alone); `reader`: one of directory/dcp to reuse."""
    reader = reader or ChunkReader(directory / DIR)
    # Nested by the keys' first part ("model", "optim"): DCP flattens it back to the same keys,
    # and checks only the top level for Stateful objects (a few microseconds per entry).
    nested: dict[str, Any] = {}
    for key, value in state.items():
        head, dot, rest = key.partition(".")
        if dot:
            nested.setdefault(head, {})[rest] = value
        else:
            nested[key] = value
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", NO_DIST_WARNING, UserWarning)
        dcp.load(
            nested,
            storage_reader=reader,
            planner=ChunkPlanner(),
            process_group=group,
            no_dist=group is None,
        )


def files_of_rank(directory: Path, rank: int) -> list[str]:
    """DCP's files rank `rank` wrote: its `__<rank>_*.distcp`; rank 0 also `.metadata` (written
    once every rank's are; the commit checks that every file is accounted for)."""
    names = sorted(os.listdir(directory / DIR))
    mine = [n for n in names if n.startswith(f"__{rank}_")]
    if rank == 0:
        mine += [n for n in names if not n.startswith("__")]
    return [f"{DIR}/{n}" for n in mine]


def saved_tensors(
    directory: Path, reader: FileSystemReader | None = None
) -> dict[str, TensorStorageMetadata]:
    """Every tensor key of directory/dcp with its whole size and dtype."""
    reader = reader or FileSystemReader(str(directory / DIR))
    meta = reader.read_metadata().state_dict_metadata
    return {k: v for k, v in meta.items() if isinstance(v, TensorStorageMetadata)}


def load(
    directory: Path,
    blocks_of: BlocksOf,
    masters: list[torch.Tensor],
    buffers: dict[str, torch.Tensor],
    shapes: dict[str, tuple[int, ...]],
    optimizer: bool,
    group: dist.ProcessGroup | None,
    into: list[dict[str, torch.Tensor] | None] | None = None,
) -> list[tuple[float, dict[str, torch.Tensor]] | None]:
    """Read the checkpoint at `directory` into this rank's `masters` (plain local tensors, in
    place) and persistent `buffers` (those it holds); with `optimizer`, also each master's step
    and FP32 moments, returned per master (None where the checkpoint has no optimizer state).
    `shapes`: every parameter of the model (all ranks check all, so all refuse alike). `into`:
    per master, FP32 moment tensors shaped like it to read into in place (the optimizer's own;
    None: new ones)."""
    reader = ChunkReader(directory / DIR)  # its metadata parsed once
    saved = saved_tensors(directory, reader)
    model = {k[6:]: tuple(v.size) for k, v in saved.items() if k.startswith("model.")}
    check_covers(f"checkpoint '{directory}'", model, shapes)
    wanted: dict[str, Any] = {}
    grouped: dict[str, tuple[tuple[int, ...], list]] = {}
    states: list[tuple[float, dict[str, torch.Tensor]] | None] = []
    for i, master in enumerate(masters):
        blocks = [b for b in blocks_of(i, master) if b[3].numel()]
        for name, shape, offset, view in blocks:
            grouped.setdefault(f"model.{name}", (shape, []))[1].append((offset, view))
        steps = [f"optim.{b[0]}.step" for b in blocks if f"optim.{b[0]}.step" in saved]
        if not (optimizer and steps):
            states.append(None)
            continue
        # Every block of a master with optimizer state had its moments saved (state_dict); what
        # no block covers (ZeRO's alignment padding in a flat partition) starts at zero.
        covered = sum(b[3].numel() for b in blocks) == master.numel()
        moments = (into[i] if into else None) or {
            k: torch.empty(master.shape, dtype=torch.float32, device=master.device) for k in MOMENTS
        }
        if not covered:
            for moment in moments.values():
                moment.zero_()
        for key, moment in moments.items():
            for name, shape, offset, view in blocks_of(i, moment):
                if view.numel():
                    grouped.setdefault(f"optim.{name}.{key}", (shape, []))[1].append((offset, view))
        step = torch.zeros((), dtype=torch.float64)
        wanted[steps[0]] = step
        states.append((step, moments))  # type: ignore[arg-type] (the step is read below)
    wanted.update({key: Blocks(shape, pieces) for key, (shape, pieces) in grouped.items()})
    host_buffers = {}
    for name in buffers:
        entry = saved.get(f"model.{name}")
        if entry is not None:
            host_buffers[name] = wanted[f"model.{name}"] = torch.empty(
                tuple(entry.size), dtype=entry.properties.dtype
            )
    read(directory, wanted, group, reader)
    with torch.no_grad():
        for name, value in host_buffers.items():
            buffers[name].copy_(value.view(buffers[name].shape))
    return [(float(s[0]), s[1]) if s else None for s in states]


class CheckpointReader(Source):
    """A checkpoint's tensors whole, by canonical name, read without a process group (DCP reads
    whole tensors in one process); one tensor is held at a time."""

    has_optimizer = True

    def __init__(self, directory: Path) -> None:
        self.origin = f"checkpoint '{directory}'"
        self.directory = directory
        self.reader = ChunkReader(directory / DIR)
        self.saved = saved_tensors(directory, self.reader)
        self.shapes = {
            k[6:]: tuple(v.size) for k, v in self.saved.items() if k.startswith("model.")
        }
        self._cached: tuple[str, torch.Tensor] | None = None

    def _load(self, key: str) -> torch.Tensor:
        if self._cached is None or self._cached[0] != key:
            entry = self.saved[key]
            value = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
            read(self.directory, {key: value}, None, self.reader)
            self._cached = (key, value)
        return self._cached[1]

    def read(self, name: str, key: str, start: int, stop: int) -> torch.Tensor:
        full = f"model.{name}" if key == "param" else f"optim.{name}.{key}"
        if full not in self.saved:
            return torch.zeros(stop - start)
        return self._load(full).reshape(-1)[start:stop].float()

    def step(self, name: str) -> float:
        key = f"optim.{name}.step"
        return float(self._load(key)) if key in self.saved else 0.0
