"""Tensor parallelism applied from outside the model: the plans over the mesh's tp axis for
bigtrain's GPT and transformers' families (plans.py), and transformers' `Conv1D` (GPT-2's layers)
split by rows and columns (conv1d.py)."""
