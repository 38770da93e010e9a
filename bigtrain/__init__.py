"""bigtrain: GPT training on FSDP2 and DeepSpeed ZeRO, with mixed precision done right and runs
that heal themselves."""

from bigtrain.utils.version import BIGTRAIN_VERSION as __version__

__all__ = ["__version__"]
