"""The fault drills' replica groups against fault_tolerance.groups (config/drills.py)."""

from __future__ import annotations

import pytest

from bigtrain.config import load_config
from bigtrain.errors import ConfigError

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["fault_tolerance.groups=3", "drill.kill_group=5"],
            "key 'drill.kill_group' got 5, expected -1 (off) or a replica group 0..2 "
            "(fault_tolerance.groups is 3)",
        ),
        (["fault_tolerance.groups=3", "drill.kill_group=-2"], "key 'drill.kill_group' got -2"),
        (
            ["fault_tolerance.groups=3", "drill.group=3"],
            "key 'drill.group' got 3, expected a replica group 0..2 (fault_tolerance.groups is 3)",
        ),
        (["fault_tolerance.groups=2", "drill.group=-1"], "key 'drill.group' got -1"),
        (
            ["drill.group=1"],
            "key 'drill.group' got 1, but fault_tolerance.groups is 1 (no replica groups)",
        ),
        (
            ["drill.kill_group=0"],
            "key 'drill.kill_group' got 0, but fault_tolerance.groups is 1 (no replica groups)",
        ),
    ],
)
def test_a_drill_in_a_group_that_does_not_exist_is_refused(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config([], overrides)
    assert message in str(err.value)


def test_a_drill_in_the_last_group_is_accepted():
    config = load_config(
        [], ["fault_tolerance.groups=3", "drill.kill_group=2", "drill.group=2", "drill.kill_step=5"]
    )
    assert (config.drill.kill_group, config.drill.group) == (2, 2)
