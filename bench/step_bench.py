"""What the step-timing benches (overhead.py, profile_off.py, sinks.py) share: their command line
(config files and key=value overrides, --steps, --rounds) and a config that trains without end,
evaluation, checkpoints or a progress bar, into a temporary run directory."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bigtrain.config import Config, load_config

ROOT = Path(__file__).resolve().parents[1]


def parse(description: str, steps_help: str = "steps per round and arm") -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("items", nargs="*", default=[], help="config files and key=value overrides")
    parser.add_argument("--steps", type=int, default=10, help=steps_help)
    parser.add_argument("--rounds", type=int, default=10)
    return parser.parse_args()


def endless_config(items: list[str], *overrides: str) -> Config:
    """configs/tiny.yaml unless `items` names config files; `overrides` (the bench's), then the
    items' key=value (the user's) on top."""
    files = [i for i in items if "=" not in i] or [str(ROOT / "configs" / "tiny.yaml")]
    out = tempfile.mkdtemp(prefix="bigtrain-bench-")
    endless = [
        f"train.out_dir={out}",
        "train.progress=false",
        "train.eval_every=0",
        "checkpoint.every=-1",
        "train.max_steps=1000000",
    ]
    return load_config(files, [*endless, *overrides, *[i for i in items if "=" in i]])
