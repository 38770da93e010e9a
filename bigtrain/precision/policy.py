"""PrecisionPolicy: the dtype of every component, resolved once at start, each with its reason.

The hardware is an input (`Hardware`), detected once by `detect_hardware()`, so that resolution
is a pure function that tests can drive with any GPU or CPU class.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from bigtrain.config.schema import PrecisionConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FP32_SOFTMAX_PARAMS = 7_000_000_000


@dataclass(frozen=True)
class Hardware:
    device_type: str
    """`cuda` or `cpu`."""
    name: str
    """Human-readable device name for the precision table."""
    cuda_capability: tuple[int, int] | None = None
    """(major, minor) of the GPU; None on CPU."""
    cpu_bf16: bool = False
    """The CPU has native BF16 arithmetic (avx512_bf16 or AMX)."""


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def detect_hardware(device: torch.device) -> Hardware:
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        return Hardware("cuda", torch.cuda.get_device_name(device), cuda_capability=cap)
    flags = _cpu_flags()
    cpu_bf16 = bool(flags & {"avx512_bf16", "amx_bf16"})
    return Hardware("cpu", f"CPU ({torch.backends.cpu.get_cpu_capability()})", cpu_bf16=cpu_bf16)


@dataclass
class PrecisionPolicy:
    master_dtype: torch.dtype
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    optimizer_state_dtype: torch.dtype
    loss_scaling: str
    fp32_softmax: bool
    allow_tf32: bool
    reasons: dict[str, str] = field(default_factory=dict)

    @property
    def autocast(self) -> bool:
        """Whether forward passes run under torch.autocast (compute dtype below FP32)."""
        return self.compute_dtype != torch.float32

    def rows(self) -> list[tuple[str, str, str]]:
        """(component, choice, reason) rows of the printed table."""
        return [
            ("master weights", dtype_name(self.master_dtype), self.reasons["master"]),
            ("compute", dtype_name(self.compute_dtype), self.reasons["compute"]),
            ("gradient reduction", dtype_name(self.reduce_dtype), self.reasons["reduce"]),
            ("optimizer states", dtype_name(self.optimizer_state_dtype), self.reasons["states"]),
            ("loss scaling", self.loss_scaling, self.reasons["loss_scaling"]),
            (
                "attention softmax",
                "fp32" if self.fp32_softmax else "compute dtype",
                self.reasons["softmax"],
            ),
            ("norms and loss", "fp32", "always: low-precision reductions lose digits"),
            ("tf32 matmuls", "on" if self.allow_tf32 else "off", self.reasons["tf32"]),
        ]

    def table(self) -> str:
        width = max(len(r[0]) for r in self.rows())
        choice = max(len(r[1]) for r in self.rows())
        return "\n".join(f"  {a:<{width}}  {b:<{choice}}  {c}" for a, b, c in self.rows())

    def to_dict(self) -> dict[str, dict[str, str]]:
        return {a: {"choice": b, "reason": c} for a, b, c in self.rows()}


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}[dtype]


def _auto_compute(hw: Hardware) -> tuple[str, str]:
    if hw.device_type == "cuda":
        assert hw.cuda_capability is not None
        major, minor = hw.cuda_capability
        if major >= 8:
            return "bf16", f"auto: {hw.name} (sm{major}{minor}) has BF16 tensor cores"
        return (
            "fp32",
            f"auto: {hw.name} (sm{major}{minor}) has no BF16; fp16 + loss scaling arrives with the precision engine",
        )
    if hw.cpu_bf16:
        return "bf16", "auto: the CPU has native BF16 (avx512_bf16/AMX)"
    return "fp32", "auto: the CPU has no native BF16"


def resolve_policy(cfg: PrecisionConfig, hw: Hardware, num_params: int) -> PrecisionPolicy:
    reasons: dict[str, str] = {}
    if cfg.compute_dtype != "auto":
        compute = cfg.compute_dtype
        reasons["compute"] = f"precision.compute_dtype={compute}"
    elif cfg.preset == "fp32":
        compute, reasons["compute"] = "fp32", "precision.preset=fp32"
    elif cfg.preset == "bf16-mixed":
        compute, reasons["compute"] = "bf16", "precision.preset=bf16-mixed"
    else:
        compute, reasons["compute"] = _auto_compute(hw)
    reasons["master"] = "FP32 master weights: small updates vanish in low precision"
    reasons["reduce"] = "gradients are FP32 (accumulated on FP32 parameters)"
    reasons["states"] = f"precision.optimizer_state_dtype={cfg.optimizer_state_dtype}"
    reasons["loss_scaling"] = "not needed: " + (
        "FP32 compute" if compute == "fp32" else "BF16 has FP32's exponent range"
    )
    if cfg.fp32_softmax is None:
        fp32_softmax = num_params >= FP32_SOFTMAX_PARAMS
        reasons["softmax"] = (
            f"auto: {num_params / 1e9:.2f}B parameters {'>=' if fp32_softmax else '<'} 7B"
        )
    else:
        fp32_softmax = cfg.fp32_softmax
        reasons["softmax"] = f"precision.fp32_softmax={fp32_softmax}"
    if hw.device_type == "cuda" and hw.cuda_capability and hw.cuda_capability[0] >= 8:
        allow_tf32 = cfg.allow_tf32
        reasons["tf32"] = f"precision.allow_tf32={cfg.allow_tf32}"
    else:
        allow_tf32 = False
        reasons["tf32"] = "no TF32 on this hardware"
    return PrecisionPolicy(
        master_dtype=DTYPES[cfg.master_dtype],
        compute_dtype=DTYPES[compute],
        reduce_dtype=torch.float32,
        optimizer_state_dtype=DTYPES[cfg.optimizer_state_dtype],
        loss_scaling=cfg.loss_scaling,
        fp32_softmax=fp32_softmax,
        allow_tf32=allow_tf32,
        reasons=reasons,
    )


def apply_to_model(model: torch.nn.Module, policy: PrecisionPolicy) -> None:
    """Set the precision knobs that live on modules (from outside the model file)."""
    for module in model.modules():
        if hasattr(module, "fp32_softmax"):
            module.fp32_softmax = policy.fp32_softmax
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = policy.allow_tf32
        torch.backends.cudnn.allow_tf32 = policy.allow_tf32
