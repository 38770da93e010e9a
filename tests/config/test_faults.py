"""The fault drills' replica groups against fault_tolerance.groups (config/faults.py)."""

from __future__ import annotations

import pytest

from bigtrain.config import load_config
from bigtrain.errors import ConfigError

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["fault_tolerance.groups=3", "fault.kill_group=5"],
            "key 'fault.kill_group' got 5, expected -1 (off) or a replica group 0..2 "
            "(fault_tolerance.groups is 3)",
        ),
        (["fault_tolerance.groups=3", "fault.kill_group=-2"], "key 'fault.kill_group' got -2"),
        (
            ["fault_tolerance.groups=3", "fault.group=3"],
            "key 'fault.group' got 3, expected a replica group 0..2 (fault_tolerance.groups is 3)",
        ),
        (["fault_tolerance.groups=2", "fault.group=-1"], "key 'fault.group' got -1"),
        (
            ["fault.group=1"],
            "key 'fault.group' got 1, but fault_tolerance.groups is 1 (no replica groups)",
        ),
        (
            ["fault.kill_group=0"],
            "key 'fault.kill_group' got 0, but fault_tolerance.groups is 1 (no replica groups)",
        ),
    ],
)
def test_a_drill_in_a_group_that_does_not_exist_is_refused(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config([], overrides)
    assert message in str(err.value)


def test_a_drill_in_the_last_group_is_accepted():
    config = load_config(
        [], ["fault_tolerance.groups=3", "fault.kill_group=2", "fault.group=2", "fault.kill_step=5"]
    )
    assert (config.fault.kill_group, config.fault.group) == (2, 2)
