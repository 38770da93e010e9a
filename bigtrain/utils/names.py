"""Canonical parameter names: the same for a parameter whatever wraps the model."""

from __future__ import annotations

import re


def canonical_name(name: str) -> str:
    """Parameter names without wrapper components (compile, DDP, DeepSpeed, activation
    checkpointing, a pipeline rank's chunks), so fingerprints and telemetry agree across backends."""
    return ".".join(
        part
        for part in name.split(".")
        if part not in WRAPPER_COMPONENTS and not PIPELINE_CHUNK.fullmatch(part)
    )


WRAPPER_COMPONENTS = frozenset({"_orig_mod", "module", "_checkpoint_wrapped_module"})
PIPELINE_CHUNK = re.compile(r"pp_chunk\d+")
"""A pipeline rank's model chunk under its root (parallel/pipeline/schedule.py's StageChunks)."""


def compress_names(names: list[str]) -> str:
    """`blocks.0.mlp.up, blocks.1.mlp.up` -> `blocks.*.mlp.up` (for the precision table)."""
    seen: list[str] = []
    for name in names:
        pattern = re.sub(r"\.\d+\.", ".*.", name)
        if pattern not in seen:
            seen.append(pattern)
    return ", ".join(seen)


def ancestors(name: str) -> list[str]:
    """`a.b.c` -> [`a`, `a.b`, `a.b.c`]: the modules a name sits in, itself included."""
    parts = name.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]
