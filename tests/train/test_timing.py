import pytest

from bigtrain.callbacks.straggler import find_stragglers

pytestmark = pytest.mark.unit


def base(**parts: float) -> dict[str, float]:
    return {
        "data": 0.01,
        "forward_backward": 0.1,
        "sync": 0.0,
        "optimizer": 0.02,
        "other": 0.0,
        **parts,
    }


def test_the_slow_part_of_the_slow_rank_is_named():
    ranks = [base(), base(forward_backward=0.3), base(), base(sync=0.3)]
    assert [(s["rank"], s["part"]) for s in find_stragglers(ranks, 1.3)] == [
        (1, "forward_backward")
    ]
    # waiting (sync) is the symptom on the fast ranks, never judged; tiny excesses are noise
    assert find_stragglers([base(other=0.001), base(other=0.008)], 1.3) == []


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
