"""Precision: the resolved policy (and, with the precision engine, loss scaling and low-precision
optimizer states)."""

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
