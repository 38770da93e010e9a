import pytest

pytestmark = pytest.mark.unit


def test_per_rank_times_become_one_wandb_key_per_part_and_rank():
    from bigtrain.telemetry.sinks import flat_record

    out = flat_record({"step": 50, "step_time_by_rank": {"data": [0.1, 0.2], "sync": [0.0, 0.3]}})
    assert out == {
        "train/step": 50,
        "timing/data/rank0": 0.1,
        "timing/data/rank1": 0.2,
        "timing/sync/rank0": 0.0,
        "timing/sync/rank1": 0.3,
    }
