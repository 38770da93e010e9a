"""Configs that runs saved (run directories, checkpoints): reading them back, and what changed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf

from bigtrain.config.load import (
    MOVED,
    REMOVED,
    RENAMED_SECTIONS,
    _merge_one,
    flatten,
    to_dict,
    validate,
)
from bigtrain.config.schema import Config


def renamed(data: dict[str, Any]) -> dict[str, Any]:
    """A saved config's sections under their current names (RENAMED_SECTIONS)."""
    return {RENAMED_SECTIONS.get(k, k): v for k, v in data.items()}


def load_saved_config(path: Path) -> Config:
    """The config.yaml a run saved (in its run directory or a checkpoint), written by this or an
    earlier bigtrain: keys that moved since (MOVED) are read at their new place, keys removed
    since (REMOVED) are dropped."""
    data = renamed(yaml.safe_load(Path(path).read_text()) or {})
    for old, new in MOVED.items():
        section, key = old.split(".")
        value = (data.get(section) or {}).pop(key, None)
        if value is not None:
            new_section, new_key = new.split(".")
            data.setdefault(new_section, {}).setdefault(new_key, value)
    for old in REMOVED:
        section, key = old.split(".")
        (data.get(section) or {}).pop(key, None)
    cfg = _merge_one(OmegaConf.structured(Config), OmegaConf.create(data), f"saved config '{path}'")
    config: Config = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    validate(config)
    return config


def config_changes(saved_yaml: str, config: Config) -> dict[str, list[Any]]:
    """Every key whose value differs between a saved config.yaml and `config`: {key: [old, new]}
    (a key that one side lacks counts as None there)."""
    saved = flatten(renamed(yaml.safe_load(saved_yaml) or {}))
    current = flatten(to_dict(config))
    return {
        key: [saved.get(key), current.get(key)]
        for key in sorted(set(saved) | set(current))
        if saved.get(key) != current.get(key)
    }
