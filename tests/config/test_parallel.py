"""`parallel.*` keys that only make sense with another setting (config/parallel.py)."""

from __future__ import annotations

import pytest

from bigtrain.config import load_config
from bigtrain.errors import ConfigError

pytestmark = pytest.mark.unit


def test_pp_split_with_one_stage_is_refused():
    with pytest.raises(ConfigError) as err:
        load_config([], ["parallel.pp_split=[2]"])
    assert str(err.value).startswith(
        "key 'parallel.pp_split' got [2], but parallel.pipeline_parallel is 1"
    )


def test_pp_split_with_two_stages_is_kept():
    config = load_config([], ["parallel.pipeline_parallel=2", "parallel.pp_split=[2]"])
    assert config.parallel.pp_split == [2]


@pytest.mark.parametrize("backend", ["local", "fsdp"])
def test_expert_parallel_on_a_dense_model_asks_for_an_moe_model(backend):
    """Said before the backend: no backend would make a dense model's experts divisible."""
    with pytest.raises(ConfigError) as err:
        load_config([], [f"parallel.backend={backend}", "parallel.expert_parallel=2"])
    assert str(err.value).startswith(
        "key 'parallel.expert_parallel' (2) needs an MoE model (model.moe.experts > 0)"
    )
