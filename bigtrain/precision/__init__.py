"""Precision: the policy resolved once from config, hardware and model size with a reason per
component (policy.py), loss scaling (scaler.py), FP32 islands (islands.py), adaptive clipping
(clip.py) and INT8 forward for linear layers (int8.py, int8_tp.py)."""

from bigtrain.precision.policy import (
    DTYPES,
    Hardware,
    PrecisionPolicy,
    apply_to_model,
    detect_hardware,
    dtype_name,
    resolve_policy,
)

__all__ = [
    "DTYPES",
    "Hardware",
    "PrecisionPolicy",
    "apply_to_model",
    "detect_hardware",
    "dtype_name",
    "resolve_policy",
]
