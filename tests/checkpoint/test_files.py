"""The checkpoint format's file layer: DCP's files, hashed as they are written and read in place
(checkpoint/state.py), agree with DCP's own reader byte for byte."""

from __future__ import annotations

import hashlib
import io
import pickle
import threading
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from bigtrain.checkpoint import storage
from bigtrain.checkpoint.blocks import Blocks, range_views
from bigtrain.checkpoint.state import DIR, read, write
from bigtrain.checkpoint.storage import ChunkHeader, ChunkPlanner, ChunkReader, dense, record_layout

pytestmark = pytest.mark.unit


def mixed_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.w": torch.randn(7, 5, generator=g),
        "model.t": torch.randn(6, 4, generator=g).t(),  # stored with its strides
        "model.bf16": torch.randn(9, generator=g).to(torch.bfloat16),
        "model.long": torch.arange(11),
        "model.big": torch.randn(48, 64, generator=g).t(),  # a record longer than SMALL
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
    [info] = FileSystemReader(str(tmp_path / DIR)).read_metadata().storage_data.values()
    with open(path, "rb") as f:
        record = record_layout(f.fileno(), info.offset, info.length, torch.float32, "w")
        with pytest.raises(ValueError, match="torch.float32 stored, torch.float64"):
            record_layout(f.fileno(), info.offset, info.length, torch.float64, "w")
    assert record[1:5] == (4, 0, (4,), (1,))
    data = path.read_bytes()[record.start : record.start + 16]
    assert torch.frombuffer(bytearray(data), dtype=torch.float32).tolist() == [0, 1, 2, 3]
    assert bytes(record.data) == data  # a short record is read whole: its data comes along


def test_a_long_record_is_parsed_from_its_ends_and_its_data_read_from_the_file(tmp_path):
    value = torch.arange(3000, dtype=torch.float32)  # 12 KB: longer than storage.SMALL
    write(tmp_path, {"model.w": value}, None)
    [path] = (tmp_path / DIR).glob("*.distcp")
    [info] = FileSystemReader(str(tmp_path / DIR)).read_metadata().storage_data.values()
    assert info.length > storage.SMALL
    with open(path, "rb") as f:
        record = record_layout(f.fileno(), info.offset, info.length, torch.float32, "w")
    assert record.data is None and record[1:5] == (3000, 0, (3000,), (1,))
    data = path.read_bytes()[record.start : record.start + 12000]
    assert torch.frombuffer(bytearray(data), dtype=torch.float32).equal(value)
    out = torch.zeros(3000)
    read(tmp_path, {"model.w": out}, None)
    assert out.equal(value)


def test_a_load_that_reshards_reads_parts_of_chunks(tmp_path):
    value = torch.arange(24.0).view(6, 4)
    write(tmp_path, {"model.w": value}, None)
    columns = torch.zeros(6, 2)  # a block of two columns: part of every row of the chunk
    wanted = {"model.w": torch.zeros(6, 4)}
    read(tmp_path, wanted, None)
    assert torch.equal(wanted["model.w"], value)
    read(tmp_path, {"model.w": Blocks((6, 4), [((0, 2), columns)])}, None)
    assert torch.equal(columns, value[:, 2:])


def test_dense_is_row_major_contiguity():
    assert dense((3, 4), (4, 1)) and dense((1, 4), (99, 1)) and dense((), ())
    assert not dense((4, 3), (1, 4))


def test_a_chunk_header_builds_nothing_but_a_tensor_layout():
    class Evil:
        def __reduce__(self):
            return (print, ("ran",))

    with pytest.raises(pickle.UnpicklingError, match="builtins.print"):
        ChunkHeader(io.BytesIO(pickle.dumps(Evil()))).load()


def test_reader_threads_read_without_grad_mode(tmp_path, monkeypatch):
    """Files are read on reader threads, and grad mode is per thread: the reads into blocks (views
    of parameters, on a backend) run under no_grad like the load that started them (under grad
    mode a resharding copy into a ZeRO or tensor-parallel block failed in autograd's view
    checks)."""
    values = {f"model.p{i}": torch.full((4, 4), float(i)) for i in range(4)}
    written = write(tmp_path, values, None, threads=2)
    assert len([n for n in written if n.endswith(".distcp")]) == 2
    seen = []
    original = ChunkReader._read

    def spy(self, *args):
        seen.append((threading.current_thread().name, torch.is_grad_enabled()))
        return original(self, *args)

    monkeypatch.setattr(ChunkReader, "_read", spy)
    flat = torch.zeros(64, requires_grad=True)
    with torch.no_grad():  # each parameter in two blocks of rows: a part of each chunk, copied
        wanted = {
            key: Blocks(
                (4, 4),
                [((r, 0), flat[16 * i + 4 * r : 16 * i + 4 * r + 8].view(2, 4)) for r in (0, 2)],
            )
            for i, key in enumerate(values)
        }
        read(tmp_path, wanted, None)
    assert flat.detach().view(4, 4, 4).equal(torch.stack(list(values.values())))
    # every read ran on a reader thread (the main thread is under the test's no_grad, so a read
    # there would prove nothing); how many threads the pool started is its own business: a
    # thread done with one file may take the next
    assert seen and all(name.startswith("bigtrain-ckpt-read") for name, _ in seen), seen
    assert not any(grad for _, grad in seen), seen


def plan_items(planner, state, tmp_path) -> list:
    reader = ChunkReader(tmp_path / DIR)
    planner.set_up_planner(state, reader.read_metadata(), True)
    return sorted(
        planner.create_local_plan().items,
        key=lambda i: (i.dest_index.fqn, tuple(i.dest_index.offset), tuple(i.storage_offsets)),
    )


def test_the_planner_reads_same_layout_chunks_whole_and_leaves_resharding_to_dcp(
    tmp_path, monkeypatch
):
    """ChunkPlanner's direct plan for tensors wanted as they were saved is the plan DCP makes
    (ReadItem for ReadItem); a tensor wanted in other blocks than were saved is planned by DCP."""
    saved = torch.arange(24.0).view(6, 4)
    write(
        tmp_path,
        {
            "model.w": torch.arange(12.0).view(3, 4),
            "model.s": Blocks((6, 4), [((0, 0), saved[:2]), ((2, 0), saved[2:])]),
            "model.r": Blocks((6, 4), [((0, 0), saved[:3]), ((3, 0), saved[3:])]),
            "optim.w.step": torch.tensor(2.0, dtype=torch.float64),
        },
        None,
    )
    flat = torch.zeros(24)
    state = {
        "model.w": torch.zeros(3, 4),
        "model.s": Blocks((6, 4), [((0, 0), torch.zeros(2, 4)), ((2, 0), torch.zeros(4, 4))]),
        "model.r": Blocks((6, 4), range_views((6, 4), flat[5:], 5)),  # a ZeRO-like range
        "optim.w.step": torch.tensor(0.0, dtype=torch.float64),
    }
    planned_by_dcp = []
    original = storage.create_default_local_load_plan
    monkeypatch.setattr(
        storage,
        "create_default_local_load_plan",
        lambda part, *args: planned_by_dcp.extend(part) or original(part, *args),
    )
    mine = plan_items(ChunkPlanner(), state, tmp_path)
    assert planned_by_dcp == ["model.r"]
    theirs = plan_items(DefaultLoadPlanner(), state, tmp_path)
    assert mine == theirs
    assert len([i for i in mine if i.dest_index.fqn == "model.s"]) == 2  # chunk for chunk
    # elements 5.. of a 6x4 tensor: the rest of row 1, rows 2-5; saved as rows 0-2 and 3-5
    assert len([i for i in mine if i.dest_index.fqn == "model.r"]) == 3  # resharded by DCP
    read(tmp_path, state, None)
    assert flat[5:].equal(saved.view(-1)[5:]) and state["model.w"].equal(
        torch.arange(12.0).view(3, 4)
    )
    assert state["optim.w.step"].item() == 2.0


def test_the_planner_names_a_missing_key_and_a_size_mismatch(tmp_path):
    write(tmp_path, {"model.w": torch.zeros(3, 4)}, None)
    with pytest.raises(RuntimeError, match="model.v"):
        plan_items(ChunkPlanner(), {"model.v": torch.zeros(3, 4)}, tmp_path)
    with pytest.raises(ValueError, match=r"model.w"):
        plan_items(ChunkPlanner(), {"model.w": torch.zeros(4, 3)}, tmp_path)


def test_a_truncated_record_is_refused_naming_the_file_and_key(tmp_path):
    """A short record is read whole: a file cut inside it is named, not parsed from what is left
    (a long record's cut data is refused by read_into, tested through the load paths)."""
    write(tmp_path, {"model.w": torch.arange(4.0)}, None)
    [path] = (tmp_path / DIR).glob("*.distcp")
    [info] = FileSystemReader(str(tmp_path / DIR)).read_metadata().storage_data.values()
    assert info.length <= storage.SMALL
    with open(path, "r+b") as f:
        f.truncate(info.offset + info.length - 10)
        with pytest.raises(ValueError, match=r"'model.w'.*the file ends 10 bytes short"):
            record_layout(f.fileno(), info.offset, info.length, torch.float32, f"{path}: 'model.w'")
    with pytest.raises(CheckpointException, match="the file ends 10 bytes short"):
        read(tmp_path, {"model.w": torch.zeros(4)}, None)  # DCP carries each rank's error
