"""The optimizer: AdamW with FP32 states (torch's) or BF16/FP16 states (LowPrecisionAdamW, math in
FP32, a Triton kernel on CUDA: adamw.py, adamw_torch.py, adamw_kernel.py), its parameter groups,
and its per-parameter state as checkpoints hold it (FP32 moments by canonical name: optimizer.py)."""
