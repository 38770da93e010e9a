"""Imported once by the fork server that run_distributed's ranks are forked from: each rank then
starts with torch, bigtrain and DeepSpeed already imported (about 4 s of CPU saved per rank)."""

import contextlib

import torch  # noqa: F401
import torch._dynamo  # noqa: F401  (building a model under a torch.device context imports it: 1 s)

import bigtrain.build  # noqa: F401
import bigtrain.parallel.backends.zero  # noqa: F401  (imports deepspeed lazily: import it here)
import tests.conftest  # noqa: F401

with contextlib.suppress(ImportError):
    import deepspeed  # noqa: F401
with contextlib.suppress(ImportError):
    import transformers  # noqa: F401  (transformers models and tokenizers in ranks)
