"""Checkpoints: one on-disk format for every backend (state.py, blocks.py), the atomic commit and
its manifest (manager.py, manifest.py), sources of weights that are not checkpoints (sources.py),
earlier versions' formats for `ckpt convert` (legacy.py, convert.py), and Hugging Face export
(export.py, hf_export.py)."""
