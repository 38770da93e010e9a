"""Checkpoints, and the only code that reads or writes their bytes: one on-disk format for every
backend (state.py, blocks.py, storage.py), a backend's tensors to and from it (state_io.py), the
atomic commit and its manifest (manager.py, manifest.py), RNG states (rng.py), sources of weights
that are not checkpoints (sources.py), earlier versions' formats for `ckpt convert` (legacy.py,
convert.py), a checkpoint's model for export and generation and the Hugging Face export
(export.py, hf_export.py)."""
