"""The checkpoint format's file layer: DCP's files, hashed as they are written and read in place
(checkpoint/state.py), agree with DCP's own reader byte for byte."""

from __future__ import annotations

import hashlib
import io
import mmap
import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from bigtrain.checkpoint.state import DIR, ChunkHeader, read, stored_tensor, write

pytestmark = pytest.mark.unit


def mixed_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.w": torch.randn(7, 5, generator=g),
        "model.t": torch.randn(6, 4, generator=g).t(),  # stored with its strides
        "model.bf16": torch.randn(9, generator=g).to(torch.bfloat16),
        "model.long": torch.arange(11),
        "model.empty": torch.empty(0, 3),
        "optim.w.step": torch.tensor(3.0, dtype=torch.float64),
    }


def test_files_are_hashed_as_written_and_read_back_equal_to_dcps_reader(tmp_path):
    state = mixed_state()
    written = write(tmp_path, state, None, threads=2)
    assert sorted(written) == sorted(f"{DIR}/{p.name}" for p in (tmp_path / DIR).iterdir())
    for name, sha in written.items():  # the hash of what is on disk, with nothing read back
        assert sha == hashlib.sha256((tmp_path / name).read_bytes()).hexdigest(), name
    mine = {k: torch.full_like(v.contiguous(), 7) for k, v in state.items()}
    read(tmp_path, mine, None)
    theirs = {k: torch.zeros_like(v.contiguous()) for k, v in state.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(theirs, storage_reader=FileSystemReader(str(tmp_path / DIR)), no_dist=True)
    for key, value in state.items():
        assert mine[key].dtype == value.dtype, key
        assert torch.equal(mine[key], value), key
        assert torch.equal(theirs[key], value), key


def test_a_chunk_of_another_dtype_than_its_metadata_says_is_refused(tmp_path):
    write(tmp_path, {"model.w": torch.arange(4, dtype=torch.float32)}, None)
    [path] = (tmp_path / DIR).glob("*.distcp")
    meta = FileSystemReader(str(tmp_path / DIR)).read_metadata()
    [info] = meta.storage_data.values()
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        view = stored_tensor(mapped, info.offset, info.length, torch.float32, "w")
        assert view.tolist() == [0.0, 1.0, 2.0, 3.0]
        del view
        with pytest.raises(ValueError, match="torch.float32 stored, torch.float64"):
            stored_tensor(mapped, info.offset, info.length, torch.float64, "w")
    mapped.close()


def test_a_chunk_header_builds_nothing_but_a_tensor_layout():
    class Evil:
        def __reduce__(self):
            return (print, ("ran",))

    with pytest.raises(pickle.UnpicklingError, match="builtins.print"):
        ChunkHeader(io.BytesIO(pickle.dumps(Evil()))).load()
