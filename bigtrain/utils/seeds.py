"""Seeds derived from a run's seed: the same number for the same inputs in every process."""

from __future__ import annotations

import hashlib


def derived_seed(tag: str, *parts: object) -> int:
    """A 63-bit generator seed from sha256 of `tag:part:part...` (e.g. the run seed and a
    parameter name): independent streams for each tag and parts, stable across processes."""
    text = ":".join([tag, *map(str, parts)])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1
