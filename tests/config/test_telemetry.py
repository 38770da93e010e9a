"""The profile.* and log.* sections: their checks, and wandb.hold_steps's move to log.hold_steps
(an error naming the new key; saved configs read it at its new place)."""

from __future__ import annotations

import pytest
import yaml

from bigtrain.config import load_config, load_saved_config, to_dict
from bigtrain.errors import ConfigError

pytestmark = pytest.mark.unit


def test_defaults_keep_wandb_alone_and_profiling_off():
    cfg = load_config([], [])
    assert cfg.log.sinks == ["wandb"] and cfg.log.hold_steps is None
    assert cfg.profile.steps == [] and cfg.profile.ranks == [0] and not cfg.profile.memory


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("profile.steps=[5]", "key 'profile.steps' got [5], expected [start, end]"),
        ("profile.steps=[5,4]", "key 'profile.steps' got [5, 4]"),
        ("profile.steps=[0,2]", "1 <= start <= end"),
        ("profile.warmup=-1", "key 'profile.warmup' got -1"),
        ("profile.ranks=[-1]", "key 'profile.ranks'"),
        ("log.sinks=[tensorboard,tensorboard]", "expected distinct names of"),
        ("log.hold_steps=-2", "key 'log.hold_steps' got -2"),
        ("wandb.hold_steps=3", "it moved: use 'log.hold_steps'"),
    ],
)
def test_wrong_values_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_config([], [override])


def test_a_saved_config_with_wandb_hold_steps_reads_it_as_log_hold_steps(tmp_path):
    saved = to_dict(load_config([], []))
    del saved["log"]  # written before log.* existed
    saved["wandb"]["hold_steps"] = 7
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(saved))
    assert load_saved_config(path).log.hold_steps == 7
