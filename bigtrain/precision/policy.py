"""PrecisionPolicy: the dtype of every component, resolved once at start, each with its reason.

The hardware is an input (`Hardware`), detected once by `detect_hardware()`, so that resolution
is a pure function that tests can drive with any GPU or CPU class.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from bigtrain.config.schema import PrecisionConfig
from bigtrain.errors import ConfigError
from bigtrain.utils.names import compress_names

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FP32_SOFTMAX_PARAMS = 7_000_000_000
FP8_PARAMS = 1_000_000_000
"""`precision.fp8.enabled` auto turns FP8 on from this size: below ~2048 wide, linear layers are
too small for FP8 GEMMs plus their casts to beat BF16 (torchao's H100 tables; the published
gains start at Llama 3 8B: +25% tensorwise on 8 H100s)."""
FP8_CAPABILITY = (8, 9)
"""FP8 tensor cores: Ada (sm89), Hopper (sm90) and later."""


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


@dataclass(frozen=True)
class Phase:
    """A span of the run [start, until) as fractions of max_steps, with its compute dtype."""

    start: float
    until: float
    compute_dtype: torch.dtype
    fp32_modules: tuple[str, ...]
    fp8: bool = False
    """The FP8 layers compute in FP8 during the phase (else in the compute dtype)."""

    @property
    def name(self) -> str:
        extra = f"+fp32[{','.join(self.fp32_modules)}]" if self.fp32_modules else ""
        return f"{'fp8+' if self.fp8 else ''}{dtype_name(self.compute_dtype)}{extra}"


@dataclass
class PrecisionPolicy:
    master_dtype: torch.dtype
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    optimizer_state_dtype: torch.dtype
    loss_scaling: str
    fp32_softmax: bool
    allow_tf32: bool
    fp32_modules: tuple[str, ...] = ()
    adaptive_clip: bool = False
    phases: tuple[Phase, ...] = ()
    int8: bool = False
    int8_patterns: tuple[str, ...] = ()
    int8_modules: tuple[str, ...] = ()
    """Canonical names of the layers converted to INT8 (filled in when the model is converted)."""
    fp8: bool = False
    fp8_auto: bool = False
    """FP8 was turned on by `auto` (layers too small to pay are then left out too)."""
    fp8_recipe: str = "tensorwise"
    fp8_all_gather: bool = False
    fp8_modules: tuple[str, ...] = ()
    """Canonical names of the layers converted to FP8 (filled in when the model is converted)."""
    fp8_excluded: dict[str, str] = field(default_factory=dict)
    """Linear layers left in BF16, each with its reason (filled in at conversion)."""
    fp8_share: float = 0.0
    """The share of the parameters in FP8 layers (set at conversion, and by the planner)."""
    fp8_fallen_back: tuple[str, ...] = ()
    """FP8 layers the run moved to BF16 (fp8_fallback events; set again at resume)."""
    reasons: dict[str, str] = field(default_factory=dict)

    def phase_at(self, step: int, max_steps: int) -> Phase:
        """The phase that optimizer step `step` (0-based) falls in."""
        fraction = step / max(1, max_steps)
        for phase in self.phases:
            if fraction < phase.until:
                return phase
        return self.phases[-1]

    def rows(self) -> list[tuple[str, str, str]]:
        """(component, choice, reason) rows of the printed table."""
        rows = [
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
            ("fp32 modules", ",".join(self.fp32_modules) or "-", self.reasons["fp32_modules"]),
            ("tf32 matmuls", "on" if self.allow_tf32 else "off", self.reasons["tf32"]),
            (
                "gradient clipping",
                "adaptive" if self.adaptive_clip else "fixed",
                self.reasons["clip"],
            ),
        ]
        if self.int8:
            modules = (
                compress_names(list(self.int8_modules))
                if self.int8_modules
                else "patterns " + ",".join(self.int8_patterns)
            )
            rows.append(("int8 forward", modules, self.reasons["int8"]))
        else:
            rows.append(("int8 forward", "off", self.reasons["int8"]))
        rows.extend(self._fp8_rows())
        if len(self.phases) > 1:
            spans = ", ".join(f"{p.name} to {p.until:.0%}" for p in self.phases)
            rows.append(("schedule", f"{len(self.phases)} phases", spans))
        return rows

    def _fp8_rows(self) -> list[tuple[str, str, str]]:
        if not self.fp8:
            return [("fp8 linears", "off", self.reasons["fp8"])]
        modules = (
            compress_names(list(self.fp8_modules))
            if self.fp8_modules
            else "the selected linear layers"  # a plan: nothing converted
        )
        gather = ", FP8 all-gather" if self.fp8_all_gather else ""
        rows = [("fp8 linears", f"{self.fp8_recipe}: {modules}", self.reasons["fp8"] + gather)]
        by_reason: dict[str, list[str]] = {}
        for name, reason in self.fp8_excluded.items():
            by_reason.setdefault(reason, []).append(name)
        if by_reason:  # one row: the start event and the sinks key rows by component
            rows.append(
                (
                    "fp8 excluded",
                    compress_names(list(self.fp8_excluded)),
                    "; ".join(f"{compress_names(n)}: {r}" for r, n in by_reason.items()),
                )
            )
        if self.fp8_fallen_back:
            rows.append(
                (
                    "fp8 fell back",
                    ", ".join(self.fp8_fallen_back),
                    "in BF16 for the rest of the run (fp8_fallback events)",
                )
            )
        return rows

    def table(self) -> str:
        width = max(len(r[0]) for r in self.rows())
        choice = max(len(r[1]) for r in self.rows())
        return "\n".join(f"  {a:<{width}}  {b:<{choice}}  {c}" for a, b, c in self.rows())

    def to_dict(self) -> dict[str, dict[str, str]]:
        return {a: {"choice": b, "reason": c} for a, b, c in self.rows()}


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}[dtype]


FP16_REFUSED_PARAMS = 20_000_000_000


def _auto_compute(hw: Hardware, num_params: int) -> tuple[str, str]:
    if hw.device_type == "cuda":
        assert hw.cuda_capability is not None
        major, minor = hw.cuda_capability
        if major >= 8:
            return "bf16", f"auto: {hw.name} (sm{major}{minor}) has BF16 tensor cores"
        if num_params >= FP16_REFUSED_PARAMS:
            raise ConfigError(
                f"precision.preset=auto: {num_params / 1e9:.0f}B parameters need BF16, which {hw.name} "
                f"(sm{major}{minor}) lacks; FP16 is refused from 20B (set precision.compute_dtype=fp32 to run anyway)"
            )
        return (
            "fp16",
            f"auto: {hw.name} (sm{major}{minor}) has no BF16: FP16 with dynamic loss scaling",
        )
    if hw.cpu_bf16:
        return "bf16", "auto: the CPU has native BF16 (avx512_bf16/AMX)"
    return "fp32", "auto: the CPU has no native BF16"


def _compute(cfg: PrecisionConfig, hw: Hardware, num_params: int) -> tuple[str, str]:
    if cfg.compute_dtype != "auto":
        return cfg.compute_dtype, f"precision.compute_dtype={cfg.compute_dtype}"
    presets = {"fp32": "fp32", "bf16-mixed": "bf16", "fp16-mixed": "fp16"}
    if cfg.preset in presets:
        return presets[cfg.preset], f"precision.preset={cfg.preset}"
    if cfg.fp8.enabled:
        return "bf16", "precision.fp8.enabled=true: FP8 linears compute beside BF16"
    return _auto_compute(hw, num_params)


def resolve_policy(cfg: PrecisionConfig, hw: Hardware, num_params: int) -> PrecisionPolicy:
    """Every component's dtype from the config, the hardware and the model size, each with its
    reason; contradictions raise ConfigError naming the keys."""
    reasons: dict[str, str] = {}
    compute, reasons["compute"] = _compute(cfg, hw, num_params)
    reasons["master"] = "FP32 master weights: small updates vanish in low precision"
    reasons["reduce"] = "FP32: sums of many small gradients lose digits in 16 bits"

    if compute == "fp16" and num_params >= FP16_REFUSED_PARAMS:
        raise ConfigError(
            f"precision.compute_dtype=fp16 with {num_params / 1e9:.0f}B parameters: FP16 is refused from 20B "
            "(activations overflow its range); use bf16"
        )
    scaling, reasons["loss_scaling"] = _loss_scaling(cfg, compute)

    state = cfg.optimizer_state_dtype
    if state == "fp16" and cfg.optimizer_state_scaling == "none":
        raise ConfigError(
            "precision.optimizer_state_dtype=fp16 with precision.optimizer_state_scaling=none: Adam's "
            "second moment underflows in FP16 without scaling; use per_tensor"
        )
    reasons["states"] = {
        "fp32": "precision.optimizer_state_dtype=fp32",
        "bf16": f"precision.optimizer_state_dtype=bf16, {cfg.optimizer_state_rounding} rounding, math in FP32",
        "fp16": "precision.optimizer_state_dtype=fp16, per-tensor scaling, math in FP32",
    }[state]

    fp32_softmax, reasons["softmax"] = _size_rule(
        cfg.fp32_softmax, "fp32_softmax", num_params, FP32_SOFTMAX_PARAMS
    )
    reasons["fp32_modules"] = "precision.fp32_modules" if cfg.fp32_modules else "none asked for"
    adaptive, reasons["clip"] = _size_rule(
        cfg.adaptive_clip, "adaptive_clip", num_params, FP16_REFUSED_PARAMS
    )

    if hw.device_type == "cuda" and hw.cuda_capability and hw.cuda_capability[0] >= 8:
        allow_tf32 = cfg.allow_tf32
        reasons["tf32"] = f"precision.allow_tf32={cfg.allow_tf32}"
    else:
        allow_tf32 = False
        reasons["tf32"] = "no TF32 on this hardware"

    fp8, fp8_auto, reasons["fp8"] = _fp8(cfg, hw, num_params, compute)
    phases = _phases(cfg, compute, scaling, fp8)
    reasons["int8"] = _int8_reason(cfg, compute)
    return PrecisionPolicy(
        master_dtype=DTYPES[cfg.master_dtype],
        compute_dtype=DTYPES[compute],
        reduce_dtype=torch.float32,
        optimizer_state_dtype=DTYPES[state],
        loss_scaling=scaling,
        fp32_softmax=fp32_softmax,
        allow_tf32=allow_tf32,
        fp32_modules=tuple(cfg.fp32_modules),
        adaptive_clip=adaptive,
        phases=phases,
        int8=cfg.int8.enabled,
        int8_patterns=tuple(cfg.int8.modules),
        fp8=fp8,
        fp8_auto=fp8_auto,
        fp8_recipe=cfg.fp8.recipe,
        reasons=reasons,
    )


def _fp8(
    cfg: PrecisionConfig, hw: Hardware, num_params: int, compute: str
) -> tuple[bool, bool, str]:
    """Whether the linear layers compute in FP8, whether `auto` chose it, and why."""
    f = cfg.fp8
    if f.enabled is False:
        return False, False, "precision.fp8.enabled=false"
    if f.enabled is None:
        cap = hw.cuda_capability
        if hw.device_type != "cuda" or cap is None:
            return (
                False,
                False,
                "auto: no FP8 tensor cores here (set precision.fp8.enabled=true to run it)",
            )
        if cap < FP8_CAPABILITY:
            return (
                False,
                False,
                f"auto: {hw.name} (sm{cap[0]}{cap[1]}) has no FP8 tensor cores (sm89+)",
            )
        if compute != "bf16":
            return False, False, f"auto: FP8 layers need BF16 compute, not {compute}"
        if num_params < FP8_PARAMS:
            return (
                False,
                False,
                f"auto: {num_params / 1e9:.2f}B parameters < 1B: layers too small for FP8 to pay",
            )
        return (
            True,
            True,
            (
                f"auto: {hw.name} (sm{cap[0]}{cap[1]}) has FP8 tensor cores, "
                f"{num_params / 1e9:.1f}B parameters >= 1B"
            ),
        )
    if compute != "bf16":
        why = (
            "FP32 compute has no low-precision region for FP8 to replace"
            if compute == "fp32"
            else "FP16 compute's loss scaling and torchao's FP8 casts do not compose (torchao "
            "trains FP8 beside BF16)"
        )
        raise ConfigError(
            f"precision.fp8.enabled=true with precision.compute_dtype={compute}: {why}; set "
            "precision.compute_dtype=bf16 (FP8 matmuls, BF16 everywhere else)"
        )
    return True, False, "precision.fp8.enabled=true"


def _loss_scaling(cfg: PrecisionConfig, compute: str) -> tuple[str, str]:
    """The loss scaling for `compute`, and why; contradictions raise ConfigError."""
    scaling = cfg.loss_scaling
    if scaling == "auto":
        scaling = "dynamic" if compute == "fp16" else "none"
        reason = (
            "auto: FP16 gradients underflow without it"
            if compute == "fp16"
            else "auto: not needed, "
            + ("FP32 compute" if compute == "fp32" else "BF16 has FP32's exponent range")
        )
    else:
        reason = f"precision.loss_scaling={scaling}"
    if compute == "fp16" and scaling == "none":
        raise ConfigError(
            "precision.compute_dtype=fp16 with precision.loss_scaling=none: FP16 gradients underflow; "
            "use loss_scaling=dynamic (or auto)"
        )
    if compute == "bf16" and scaling != "none" and not cfg.allow_bf16_loss_scaling:
        raise ConfigError(
            f"precision.loss_scaling={scaling} with precision.compute_dtype=bf16: BF16 needs no loss scaling; "
            "set precision.allow_bf16_loss_scaling=true if you mean it"
        )
    if compute == "fp32" and scaling != "none":
        raise ConfigError(
            f"precision.loss_scaling={scaling} with FP32 compute does nothing useful; use none"
        )
    return scaling, reason


def _int8_reason(cfg: PrecisionConfig, compute: str) -> str:
    i = cfg.int8
    if not i.enabled:
        return "precision.int8.enabled=false"
    calibration = (
        f"SmoothQuant scales after {i.calibration_steps} steps ({i.calibration})"
        if i.calibration_steps
        else "no smoothing"
    )
    return (
        f"precision.int8: activations {i.activation_scheme} per token, weights symmetric per "
        f"channel, {calibration}; backward in {compute} (STE); excluded: {', '.join(i.exclude)}"
    )


def _size_rule(
    explicit: bool | None, key: str, num_params: int, threshold: int
) -> tuple[bool, str]:
    """An on/off choice that `auto` (None) makes by model size, with its reason."""
    if explicit is not None:
        return explicit, f"precision.{key}={explicit}"
    on = num_params >= threshold
    return (
        on,
        f"auto: {num_params / 1e9:.2f}B parameters {'>=' if on else '<'} {threshold // 10**9}B",
    )


def _phases(cfg: PrecisionConfig, compute: str, scaling: str, fp8: bool) -> tuple[Phase, ...]:
    if not cfg.schedule:
        return (Phase(0.0, 1.0, DTYPES[compute], tuple(cfg.fp32_modules), fp8),)
    phases, start = [], 0.0
    for i, p in enumerate(cfg.schedule):
        key = f"precision.schedule[{i}]"
        if p.compute_dtype not in ("bf16", "fp16", "fp32"):
            raise ConfigError(
                f"{key}.compute_dtype got {p.compute_dtype!r}, expected bf16, fp16 or fp32"
            )
        if not start < p.until <= 1.0:
            raise ConfigError(
                f"{key}.until got {p.until}, expected a fraction above the previous phase's ({start}) and <= 1"
            )
        if p.compute_dtype == "fp16" and scaling == "none":
            raise ConfigError(
                f"{key}.compute_dtype=fp16 needs precision.loss_scaling=dynamic or static"
            )
        phase_fp8 = fp8 if p.fp8 is None else p.fp8
        if p.fp8 and not fp8:
            raise ConfigError(
                f"{key}.fp8=true, but precision.fp8 is off: the FP8 layers are made once, at "
                "build; set precision.fp8.enabled=true (and fp8: false in the phases without it)"
            )
        if phase_fp8 and p.compute_dtype != "bf16":
            raise ConfigError(
                f"{key}: FP8 layers with compute_dtype={p.compute_dtype}; FP8 phases compute in "
                f"bf16 (set {key}.fp8=false, or compute_dtype: bf16)"
            )
        phases.append(
            Phase(
                start,
                p.until,
                DTYPES[p.compute_dtype],
                tuple(cfg.fp32_modules) + tuple(p.fp32_modules),
                phase_fp8,
            )
        )
        start = p.until
    if start != 1.0:
        raise ConfigError(
            f"precision.schedule: the last phase ends at {start}, expected until: 1.0"
        )
    return tuple(phases)


def apply_to_model(model: torch.nn.Module, policy: PrecisionPolicy) -> None:
    """Set the precision knobs that live on modules (from outside the model file)."""
    for module in model.modules():
        if hasattr(module, "fp32_softmax"):
            module.fp32_softmax = policy.fp32_softmax
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = policy.allow_tf32
        torch.backends.cudnn.allow_tf32 = policy.allow_tf32
