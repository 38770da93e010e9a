"""bigtrain: GPT training on FSDP2 and DeepSpeed ZeRO, with mixed precision done right and runs
that heal themselves."""

__version__ = "0.1.0"
