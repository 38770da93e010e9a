"""Imported once by the fork server that run_distributed's ranks are forked from: each rank then
starts with torch, bigtrain and DeepSpeed already imported (about 4 s of CPU saved per rank)."""

import contextlib

import torch  # noqa: F401

import bigtrain.build  # noqa: F401
import bigtrain.parallel.zero  # noqa: F401  (imports deepspeed lazily: import it here)
import tests.conftest  # noqa: F401

with contextlib.suppress(ImportError):
    import deepspeed  # noqa: F401
