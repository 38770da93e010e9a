import pytest
import torch

from bigtrain.utils.tables import DeviceTable, chunk_layout

pytestmark = pytest.mark.unit


def test_chunk_layout_spreads_large_tensors_and_skips_empty_ones():
    chunk_tensor, chunk_start, begin = chunk_layout((5, 0, 12), 4)
    assert chunk_tensor == [0, 0, 2, 2, 2]
    assert chunk_start == [0, 4, 0, 4, 8]
    assert begin == [0, 2, 2, 5]  # tensor 1 has no chunk


def test_device_table_is_copied_only_when_its_values_change():
    table = DeviceTable()
    cpu = torch.device("cpu")
    first = table.get((1, 2, 3), cpu)
    assert first.dtype == torch.int64 and first.tolist() == [1, 2, 3]
    assert table.get((1, 2, 3), cpu) is first  # unchanged: no new copy
    second = table.get((1, 2, 4), cpu)
    assert second is not first and second.tolist() == [1, 2, 4]
    assert first.tolist() == [1, 2, 3]  # never written in place: kernels still reading it see it
