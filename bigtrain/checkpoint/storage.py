"""DCP's files, written and read the fast way: the storage layer under checkpoint/state.py.

The files are DCP's own (FileSystemWriter's `.distcp` files of torch.save records and its
`.metadata`), so DCP's FileSystemReader and tools read them too. Three things change how they
are handled, all measured in bench/checkpoint.py:
  - writing, each file is hashed as its bytes go by (`HashingFileSystem`), so the manifest's
    sha256 needs no second read of the checkpoint;
  - planning a load, a tensor wanted as the very chunks it was saved as (a resume on the same
    layout, every backend's usual one) reads each chunk whole (`ChunkPlanner`), without DCP's
    general overlap search; DCP plans everything else (resharding);
  - reading, DCP's reader feeds every chunk to torch.load through a Python file view and a
    pure-Python unpickler, which costs several times the copy itself. `ChunkReader` reads the
    record's zip directory and its tensor header only (`ChunkHeader`: a C unpickler that builds
    nothing, checked against DCP's metadata; a short record, such as a step count, whole in
    one read with its data), then reads the stored bytes straight into the tensor the load
    asks for (when the chunk lands whole in a contiguous host tensor, the usual case), or into
    a buffer it copies the asked-for part from (resharding, device tensors).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import io
import os
import pickle
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from bigtrain.checkpoint.blocks import Blocks


class HashingFileSystem(FileSystem):
    """DCP's local file system, hashing every file it writes as the bytes go by (sha256 by file
    name; a rename carries the hash along, as the metadata file's commit does)."""

    def __init__(self) -> None:
        super().__init__()
        self.sha256: dict[str, str] = {}

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            digest = hashlib.sha256()
            yield HashingWriter(stream, digest)
        self.sha256[Path(path).name] = digest.hexdigest()

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)
        if Path(path).name in self.sha256:
            self.sha256[Path(new_path).name] = self.sha256.pop(Path(path).name)


class HashingWriter:
    """A file opened for writing that hashes what is written through it (DCP writes, tells,
    flushes and closes it; nothing seeks back)."""

    def __init__(self, stream, digest) -> None:
        self.stream, self.digest = stream, digest

    def write(self, data) -> int:
        self.digest.update(data)
        return self.stream.write(data)

    def tell(self) -> int:
        return self.stream.tell()

    def flush(self) -> None:
        self.stream.flush()

    def fileno(self) -> int:
        return self.stream.fileno()

    def close(self) -> None:
        self.stream.close()


class ChunkReader(FileSystemReader):
    """DCP's file reader, one copy per chunk (the module's docstring). bigtrain's checkpoints
    hold tensors only and no stream transforms; anything else is refused. A reader parses its
    `.metadata` once (a load asks for it, and so do the key checks before it and every further
    load through the same reader)."""

    _metadata = None

    def read_metadata(self, *args, **kwargs):
        if args or kwargs:  # another rank's metadata file: not what is kept
            return super().read_metadata(*args, **kwargs)
        if self._metadata is None:
            self._metadata = super().read_metadata()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def set_up_storage_reader(self, metadata, is_coordinator: bool, *args, **kwargs) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self.dtypes = {
            fqn: entry.properties.dtype
            for fqn, entry in metadata.state_dict_metadata.items()
            if isinstance(entry, TensorStorageMetadata)
        }

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(
                item
            )
        # A thread per file (a synchronous save writes several): the reads release the GIL.
        threads = min(len(per_file), os.cpu_count() or 1, 4)
        if threads > 1:
            with ThreadPoolExecutor(threads, thread_name_prefix="bigtrain-ckpt-read") as pool:
                list(pool.map(lambda entry: self._read_file(*entry, planner), per_file.items()))
        else:
            for relative_path, items in per_file.items():
                self._read_file(relative_path, items, planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    @torch.no_grad()  # grad mode is per thread: the targets may be views of parameters
    def _read_file(self, relative_path: str, items: list, planner: LoadPlanner) -> None:
        path = self.fs.concat_path(self.path, relative_path)
        with open(path, "rb", buffering=0) as file:
            for item in items:
                self._read(file.fileno(), item, planner, path)

    def _read(self, fd: int, item, planner: LoadPlanner, path) -> None:
        info = self.storage_data[item.storage_index]
        fqn = item.storage_index.fqn
        where = f"{path}: '{fqn}'"
        if item.type == LoadItemType.BYTE_IO or info.transform_descriptors:
            raise ValueError(f"{where} is not a plain tensor chunk")
        dtype = self.dtypes[fqn]
        record = record_layout(fd, info.offset, info.length, dtype, where)
        target = planner.resolve_tensor(item).detach()
        whole = not any(item.storage_offsets) and tuple(item.lengths) == record.size
        if whole and dense(record.size, record.stride) and fits(target, record.size, dtype):
            read_into(fd, target, record, record.first * dtype.itemsize, where)
        else:
            stored = torch.empty(record.numel, dtype=dtype)
            read_into(fd, stored, record, 0, where)
            tensor = stored.as_strided(record.size, record.stride, record.first)
            for dim, (at, length) in enumerate(
                zip(item.storage_offsets, item.lengths, strict=True)
            ):
                tensor = tensor.narrow(dim, at, length)  # the part of the chunk this item reads
            if target.size() != tensor.size():
                raise ValueError(f"{where}: {tuple(tensor.size())} read for {tuple(target.size())}")
            target.copy_(tensor)
        planner.commit_tensor(item, target)


class ChunkPlanner(DefaultLoadPlanner):
    """DCP's load planner, with the common case planned directly: a tensor wanted as exactly the
    chunks it was saved as reads each chunk whole, in one read item; every other tensor (another
    layout, world size or mesh) goes through DCP's own resharding plan. Keys must all be in the
    checkpoint (DCP's strict load)."""

    def __init__(self) -> None:
        super().__init__(flatten_sharded_tensors=False)  # bigtrain has no ShardedTensor

    def create_local_plan(self) -> LoadPlan:
        saved = self.metadata.state_dict_metadata
        items: list[ReadItem] = []
        for fqn, obj in self.state_dict.items():
            chunks = same_chunks(obj, saved.get(fqn))
            if chunks is None:  # DCP plans it (and names a missing key or a size mismatch)
                items += create_default_local_load_plan({fqn: obj}, self.metadata).items
                continue
            for i, chunk in enumerate(chunks):
                index = MetadataIndex(fqn, chunk.offsets, i)
                zeros = torch.Size([0] * len(chunk.offsets))
                items.append(ReadItem(LoadItemType.TENSOR, index, zeros, index, zeros, chunk.sizes))
        return LoadPlan(items)


def same_chunks(obj, saved) -> list[ChunkStorageMetadata] | None:
    """The chunks `obj` (a plain tensor, or `Blocks`) asks for when they are exactly the saved
    tensor's chunks, in the same order; else None."""
    if not isinstance(saved, TensorStorageMetadata) or not isinstance(obj, torch.Tensor):
        return None
    if isinstance(obj, Blocks):
        chunks = obj.__create_chunk_list__()
    elif hasattr(obj, "__create_chunk_list__"):  # a DTensor: DCP knows its mesh
        return None
    else:
        chunks = [ChunkStorageMetadata(torch.Size([0] * obj.dim()), obj.size())]
    return chunks if saved.size == obj.size() and chunks == saved.chunks else None


class Record(NamedTuple):
    """Where a torch.save record keeps its tensor: the storage's first byte in the file, its
    element count, the tensor's storage offset, size and stride; `data`, the storage's bytes
    when the record was short enough to be read whole (else they are read from the file)."""

    start: int
    numel: int
    first: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    data: memoryview | None


SMALL = 8192
"""A record this short (a step count, a norm's weight) is read whole in one read: its zip
directory, header and data, parsed from memory."""


def record_layout(fd: int, offset: int, length: int, dtype: torch.dtype, where: str) -> Record:
    """The layout of the torch.save record at [offset, offset + length) of file `fd`; its dtype
    must be `dtype` (DCP's metadata)."""
    if length <= SMALL:
        raw = os.pread(fd, length, offset)
        if len(raw) != length:
            raise ValueError(f"{where}: the file ends {length - len(raw)} bytes short")
        record = torch._C.PyTorchFileReader(io.BytesIO(raw))
    else:
        record = torch._C.PyTorchFileReader(Span(fd, offset, length))
    storage, first, size, stride = ChunkHeader(io.BytesIO(record.get_record("data.pkl"))).load()
    _, storage_type, key, _, numel = storage
    stored = storage_dtype(storage_type)
    name = f"data/{key}"
    if stored != dtype or record.get_record("byteorder") != b"little":
        raise ValueError(
            f"{where}: {stored} stored, {dtype} in the metadata (or not little-endian)"
        )
    nbytes = numel * dtype.itemsize
    if record.get_record_size(name) != nbytes:
        raise ValueError(f"{where}: {record.get_record_size(name)} bytes for {numel} {dtype}")
    if all(size) and first + sum((n - 1) * s for n, s in zip(size, stride, strict=True)) >= numel:
        raise ValueError(f"{where}: a tensor of {size} at {first} overruns its {numel} elements")
    at = record.get_record_offset(name)
    if at + nbytes > length:
        raise ValueError(f"{where}: {nbytes} bytes at {at} overrun the {length}-byte record")
    data = memoryview(raw)[at : at + nbytes] if length <= SMALL else None
    return Record(offset + at, numel, first, size, stride, data)


def dense(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether a tensor of `size` and `stride` is row-major contiguous."""
    expected = 1
    for n, s in zip(reversed(size), reversed(stride), strict=True):
        if n != 1 and s != expected:
            return False
        expected *= n
    return True


def fits(target: torch.Tensor, size: tuple[int, ...], dtype: torch.dtype) -> bool:
    """Whether a chunk of `size` and `dtype` can be read straight into `target`'s memory."""
    return (
        target.device.type == "cpu"
        and target.dtype == dtype
        and tuple(target.size()) == size
        and target.is_contiguous()
    )


def read_into(fd: int, tensor: torch.Tensor, record: Record, skip: int, where: str) -> None:
    """Fill contiguous host `tensor` with `record`'s storage bytes from byte `skip` on: from
    memory when the record was read whole, else straight from file `fd`."""
    if not tensor.numel():
        return
    buffer = memoryview(tensor.view(-1).view(torch.uint8).numpy())
    if record.data is not None:
        buffer[:] = record.data[skip : skip + len(buffer)]
        return
    at, done = record.start + skip, 0
    while done < len(buffer):
        n = os.preadv(fd, [buffer[done:]], at + done)
        if n <= 0:
            raise ValueError(f"{where}: the file ends {len(buffer) - done} bytes short")
        done += n


class Span:
    """A read-only file over bytes [offset, offset + length) of file `fd`. torch's zip reader
    makes a dozen small reads, of the record's directory (at its end) and headers (at its
    start): each end's first WINDOW bytes are read once and served from memory."""

    WINDOW = 4096

    def __init__(self, fd: int, offset: int, length: int) -> None:
        self.fd, self.offset, self.length, self.at = fd, offset, length, 0
        self.head = os.pread(fd, min(length, self.WINDOW), offset)
        self.tail_at = max(length - self.WINDOW, 0)
        self.tail = os.pread(fd, length - self.tail_at, offset + self.tail_at)

    def seek(self, at: int, whence: int = 0) -> int:
        self.at = at + (0, self.at, self.length)[whence]
        return self.at

    def tell(self) -> int:
        return self.at

    def read(self, n: int = -1) -> bytes:
        start = self.at
        stop = self.length if n < 0 else min(start + n, self.length)
        self.at = max(stop, start)
        if stop <= len(self.head):
            return self.head[start:stop]
        if start >= self.tail_at:
            return self.tail[start - self.tail_at : stop - self.tail_at]
        return os.pread(self.fd, stop - start, self.offset + start)


class ChunkHeader(pickle.Unpickler):
    """Unpickles a torch.save'd tensor's data.pkl to (storage id, storage offset, size, stride),
    building nothing: only the tensor rebuild function and storage classes are known to it."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return layout
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name.endswith("Storage"):
            return name
        raise pickle.UnpicklingError(f"a checkpoint chunk refers to {module}.{name}")

    def persistent_load(self, pid):
        return pid  # ('storage', storage class name, key, location, numel)


def layout(storage, first: int, size, stride, *_) -> tuple:
    return storage, first, tuple(size), tuple(stride)


@functools.cache
def storage_dtype(name: str) -> torch.dtype:
    """torch.FloatStorage -> torch.float32 (the legacy classes warn when asked)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return getattr(torch, name).dtype
