"""bigtrain's version, readable from every layer (the package's `__init__` re-exports it)."""

BIGTRAIN_VERSION = "0.1.0"
"""Kept equal to pyproject.toml's `version`."""
