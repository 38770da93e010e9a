"""FP8 matmuls for linear layers, through torchao's float8 training (`Float8Linear`).

A converted layer computes y = x W^T + b with x, W and (in backward) dy cast to FP8 with dynamic
scales (scale = FP8 max / amax, per tensor or per row: the recipe), the products summed in high
precision, the result in the compute dtype (BF16); the optimizer updates the FP32 master weights
as for any layer. torchao does the casts and the scaled matmuls; bigtrain adds what a run needs
around them (`Fp8Linear`):

- a switch per layer, `fp8`: off, the layer is a BF16 linear (a precision phase without FP8, or
  a layer that fell back, callbacks/fp8_health.py); the weights and their names are the same;
- statistics in a small buffer per layer, updated without a host sync in every forward: the
  input's amax (zero, Inf or NaN is trouble), whether the FP8 result turned a finite input
  non-finite, and on sampled steps (`watch`) the relative error of the FP8 result against the
  layer's BF16 result on the same input and the share of nonzero inputs FP8 flushes to zero.
  Each is a maximum, so a recomputed forward (activation checkpointing) changes nothing;
- the compute dtype of the device the input is on (torchao reads CUDA's autocast only).

Under FSDP2 with FP8 all-gather (tensorwise) the weights travel as FP8 with scales computed
once per step for all layers (`precompute_scales`); a layer that falls back gathers in BF16
from then on (`gather_in_bf16`). Under tensor parallelism FP8 layers use torchao's float8
styles (the input all-gathered in FP8), which a layer in BF16 bypasses.
"""

from __future__ import annotations

import fnmatch
import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from bigtrain.config.schema import Fp8Config
from bigtrain.errors import ConfigError
from bigtrain.utils.names import ancestors, canonical_name
from bigtrain.utils.tensors import autocast_dtype, local_tensor

ALIGN = 16
"""FP8 GEMMs (cuBLASLt through torch._scaled_mm) take matrices whose dimensions are multiples of 16."""
STATS = ("amax", "nonfinite", "error", "underflow")
"""What each FP8 layer's `fp8_stats` buffer holds, in order (module docstring)."""
E4M3_MAX = 448.0
E4M3_TINY = 2.0**-10
"""Half of e4m3's smallest subnormal (2^-9): a scaled value below it rounds to zero."""


def torchao_float8() -> Any:
    """torchao.float8, or a ConfigError saying how to install it. Imported only when FP8 is on:
    torchao logs about its CUDA-only extensions on import."""
    quiet = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [q.level for q in quiet]
    if not torch.cuda.is_available():  # its CUDA kernels' libraries cannot load here: expected
        for q in quiet:
            q.setLevel(logging.ERROR)
    try:
        import torchao.float8 as float8
    except ImportError as e:
        raise ConfigError(
            "precision.fp8.enabled=true needs torchao (pinned: pip install 'bigtrain[fp8]', "
            f"torchao==0.18.0): {e}"
        ) from e
    finally:
        for q, level in zip(quiet, levels, strict=True):
            q.setLevel(level)
    return float8


def float8_config(cfg: Fp8Config, all_gather: bool) -> Any:
    """torchao's Float8LinearConfig for the recipe, with bigtrain's all-gather and emulation."""
    float8 = torchao_float8()
    base = float8.Float8LinearConfig.from_recipe_name(cfg.recipe)
    fields = {**vars(base), "emulate": cfg.emulate, "enable_fsdp_float8_all_gather": all_gather}
    return float8.Float8LinearConfig(**fields)


def _linear_base() -> type:
    return torchao_float8().float8_linear.Float8Linear


class _Fp8LinearMixin:
    """Fp8Linear's own behaviour (module docstring); the class is made at first use, on top of
    torchao's Float8Linear (which the float8 tensor-parallel styles require)."""

    fp8: bool
    watch: bool
    fp8_stats: torch.Tensor
    drill_amax: float | None
    drill_outlier: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torchao.float8.distributed_utils import tensor_already_casted_to_fp8
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

        dtype = autocast_dtype(x.device.type)
        casted = tensor_already_casted_to_fp8(x)
        if dtype is not None and not casted:
            x = x.to(dtype)
        weight = self.weight
        if self.drill_outlier and not casted:  # drill.fp8_outlier_from (callbacks/drills.py)
            x, weight = outlier_channel(x, high_precision(weight), self.drill_outlier)
        seen = high_precision(x) if casted else x
        if self.fp8:
            if self.drill_amax is not None and not casted:  # drill.fp8_amax_step
                x = self._cast_with_amax(x, self.drill_amax)
            y = matmul_with_hp_or_float8_args.apply(
                x, weight.t(), self.linear_mm_config, self.config
            )
            self._observe(seen, y, weight)
            return y if self.bias is None else y + self.bias.to(y.dtype)
        self._observe(seen, None, weight)
        return _bf16_linear(x, weight, self.bias)  # one rounding, as nn.Linear's

    def _cast_with_amax(self, x: torch.Tensor, amax: float) -> torch.Tensor:
        """The input cast to FP8 with the scale an amax of `amax` gives (a drill: Inf or NaN)."""
        from torchao.float8.float8_training_tensor import (
            GemmInputRole,
            hp_tensor_and_scale_to_float8,
        )

        scale = torch.tensor(E4M3_MAX, device=x.device) / amax
        return hp_tensor_and_scale_to_float8(
            x,
            scale,
            self.config.cast_config_input.target_dtype,
            self.linear_mm_config,
            GemmInputRole.INPUT,
        )

    @torch.no_grad()
    def _observe(self, x: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor) -> None:
        """Fold this forward's statistics into `fp8_stats` (maxima: no host sync). On a
        watched step the first forward also measures the error against BF16, then unwatches."""
        x_local, y_local = local_tensor(x), local_tensor(y)
        stats = self.fp8_stats
        amax = x_local.abs().amax().float() if x_local.numel() else stats.new_zeros(())
        stats[0] = torch.maximum(stats[0], amax)  # NaN stays NaN
        if y is None:  # the layer runs in BF16
            return
        broke = (~torch.isfinite(y_local).all()) & torch.isfinite(amax)
        stats[1] = torch.maximum(stats[1], broke.float())
        if not self.watch:
            return
        self.watch = False  # the step's first micro-batch only
        reference = local_tensor(_bf16_linear(x, weight)).float()
        error = (y_local.float() - reference).norm() / reference.norm().clamp_min(1e-30)
        stats[2] = torch.maximum(stats[2], torch.nan_to_num(error, nan=float("inf")))
        nonzero = x_local != 0
        scaled = x_local.abs().float() * (E4M3_MAX / amax.clamp_min(1e-30))
        flushed = (nonzero & (scaled < E4M3_TINY)).sum() / nonzero.sum().clamp_min(1)
        stats[3] = torch.maximum(stats[3], flushed.float())


def _bf16_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x W^T (+ b) in the input's (compute) dtype, without FP8."""
    x = high_precision(x)
    bias = None if bias is None else bias.to(x.dtype)
    return F.linear(x, high_precision(weight).to(x.dtype), bias)


def outlier_channel(
    x: torch.Tensor, weight: torch.Tensor, factor: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x with its first input channel times `factor` and W with that column divided by it: the
    same product in exact arithmetic (an activation outlier that a small weight absorbs, as in
    large models), which tensorwise FP8 scales by the outlier, flushing the other inputs."""
    scale = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
    scale[0] = factor
    return x * scale, weight / scale.to(weight.dtype)


def high_precision(t: torch.Tensor) -> torch.Tensor:
    """A tensor torchao may have cast to FP8 (a Float8TrainingTensor, also inside a DTensor),
    back in its original precision; any other tensor as is."""
    inner = local_tensor(t)
    if hasattr(inner, "to_original_precision"):
        if inner is t:
            return t.to_original_precision()
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(
            inner.to_original_precision(), t.device_mesh, t.placements, run_check=False
        )
    return t


_CLASSES: dict[str, type] = {}


def fp8_linear_class() -> type:
    """Fp8Linear: torchao's Float8Linear with bigtrain's switch and statistics."""
    if "Fp8Linear" not in _CLASSES:
        _CLASSES["Fp8Linear"] = type(
            "Fp8Linear",
            (_Fp8LinearMixin, _linear_base()),
            {"__module__": __name__, "__doc__": _Fp8LinearMixin.__doc__},
        )
    return _CLASSES["Fp8Linear"]


def is_fp8_linear(module: nn.Module) -> bool:
    return isinstance(module, _Fp8LinearMixin)


def make_fp8_linear(source: nn.Linear, config: Any) -> nn.Module:
    """An Fp8Linear holding `source`'s Parameter objects (names, ties and shards unchanged)."""
    layer = fp8_linear_class().from_float(source, config=config)
    for key, value in vars(source).items():  # e.g. residual_scaled_init
        if not key.startswith("_") and key not in vars(layer) and not callable(value):
            setattr(layer, key, value)
    layer.fp8, layer.watch = True, False
    layer.drill_amax, layer.drill_outlier = None, 0.0
    device = source.weight.device
    layer.register_buffer("fp8_stats", torch.zeros(len(STATS), device=device), persistent=False)
    return layer


def reset_stats(layers: dict[str, nn.Module]) -> None:
    for layer in layers.values():
        layer.fp8_stats.zero_()


# --- which layers convert, and why the others do not ---------------------------------------------


def _too_small(recipe: str, out_features: int, in_features: int) -> bool:
    """torchao's performance filter (float8_linear_utils, measured on H100): shapes whose FP8
    GEMM plus casts are not faster than BF16."""
    n, k = out_features, in_features
    if recipe == "tensorwise":
        return k <= 4096 and n <= 1024
    return n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048)


def _inside(name: str, patterns: tuple[str, ...]) -> str | None:
    """The first pattern that matches `name` or a module it sits in."""
    return next(
        (p for p in patterns if any(fnmatch.fnmatchcase(a, p) for a in ancestors(name))), None
    )


def select_fp8_layers(
    model: nn.Module,
    cfg: Fp8Config,
    auto: bool,
    fp32_patterns: tuple[str, ...] = (),
) -> tuple[list[tuple[str, str, nn.Linear]], dict[str, str]]:
    """The linear layers to convert, as (module name, canonical name, layer), and the excluded
    ones by canonical name with the reason each stays in BF16. `auto`: FP8 was turned on by the
    policy, which then also leaves out layers too small for FP8 to pay."""
    from bigtrain.precision.int8 import Int8Layer, token_routers

    chosen, excluded, routes = [], {}, token_routers(model)
    modules = dict(model.named_modules())
    for name, module in modules.items():
        cname = canonical_name(name)
        if not cname:
            continue
        if not isinstance(module, nn.Linear):
            if type(module).__name__.endswith("Experts") or cname.endswith("experts"):
                excluded[cname] = (
                    "batched expert weights: torchao 0.18's grouped FP8 GEMM is a CUDA-only "
                    "prototype"
                )
            continue
        if is_fp8_linear(module) or not any(fnmatch.fnmatchcase(cname, p) for p in cfg.modules):
            continue
        pattern = next((p for p in cfg.exclude if fnmatch.fnmatchcase(cname, p)), None)
        out_features, in_features = module.weight.shape
        if pattern is not None:
            excluded[cname] = f"precision.fp8.exclude '{pattern}'"
        elif routes(name):
            excluded[cname] = "MoE router: its logits choose the experts"
        elif isinstance(module, Int8Layer):
            raise ConfigError(
                f"precision.fp8.modules and precision.int8.modules both select '{cname}': a layer "
                "computes in INT8 or in FP8; leave it out of one (precision.fp8.exclude or "
                "precision.int8.exclude)"
            )
        elif (island := _inside(cname, fp32_patterns)) is not None:
            excluded[cname] = f"kept in FP32 by precision.fp32_modules '{island}'"
        elif out_features % ALIGN or in_features % ALIGN:
            excluded[cname] = (
                f"{out_features}x{in_features}: FP8 GEMMs need both dimensions divisible by {ALIGN}"
            )
        elif auto and _too_small(cfg.recipe, out_features, in_features):
            excluded[cname] = (
                f"{out_features}x{in_features}: too small for FP8 to pay ({cfg.recipe}, torchao's "
                "H100 table)"
            )
        else:
            chosen.append((name, cname, module))
    return chosen, excluded


def convert_to_fp8(
    model: nn.Module,
    cfg: Fp8Config,
    all_gather: bool,
    auto: bool = False,
    fp32_patterns: tuple[str, ...] = (),
) -> tuple[dict[str, nn.Module], dict[str, str]]:
    """Replace the selected linear layers by Fp8Linear in place (before sharding and wrapping):
    the converted layers by canonical name, and the excluded ones with their reasons."""
    chosen, excluded = select_fp8_layers(model, cfg, auto, fp32_patterns)
    if not chosen:
        raise ConfigError(
            f"precision.fp8.modules {list(cfg.modules)} (minus precision.fp8.exclude "
            f"{list(cfg.exclude)} and the automatic exclusions: {excluded or 'none'}) selects "
            "no linear layer of the model"
        )
    config = float8_config(cfg, all_gather)
    converted = {}
    for name, cname, module in chosen:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        layer = make_fp8_linear(module, config)
        setattr(parent, child, layer)
        converted[cname] = layer
    return converted, excluded


# --- FSDP2 -------------------------------------------------------------------------------------


def precompute_scales(model: nn.Module) -> None:
    """The FP8 all-gather's weight scales of every layer at once (one all-reduce of amaxes), after
    the optimizer step; a model without FP8 all-gather weights is left alone."""
    torchao_float8().precompute_float8_dynamic_scale_for_fsdp(model)


def _held(weight: torch.Tensor) -> torch.Tensor:
    """The tensor object a (sharded) parameter holds: a DTensor's own local tensor, not the
    view `to_local()` makes."""
    return getattr(weight, "_local_tensor", weight)


def gathers_in_fp8(layer: nn.Module) -> bool:
    weight = _held(layer.weight)
    return hasattr(weight, "fsdp_pre_all_gather") and not getattr(weight, "bf16_gather", False)


def gather_in_bf16(layer: nn.Module) -> None:
    """From the next all-gather on, FSDP2 gathers this layer's weight in the parameter dtype,
    not FP8. FSDP2 keeps the gather's buffers from the first all-gather, so they are dropped
    here, while the weight is sharded (between steps), to be made again in the new dtype."""
    weight = _held(layer.weight)
    if not hasattr(weight, "fsdp_pre_all_gather"):
        return
    weight.bf16_gather = True
    weight.__class__ = _bf16_gather_class(type(weight))
    for param in _fsdp_params_of(layer):
        param.all_gather_outputs = []
        if hasattr(param, "_unsharded_param"):
            del param._unsharded_param
        param._unsharded_inner_tensors = []


def _fsdp_params_of(layer: nn.Module) -> list:
    """FSDP2's records (FSDPParam) of the layer's weight (FSDP2 internals: a test checks that
    a layer gathers in BF16 after gather_in_bf16)."""
    group = getattr(layer, "_fsdp_owner", None)
    if group is None:
        return []
    return [p for p in group.fsdp_params if p.sharded_param is layer.weight]


def _bf16_gather_class(base: type) -> type:
    """The weight's FP8-gathering tensor subclass with its all-gather in the parameter dtype."""
    name = f"BF16Gather{base.__name__}"
    if name not in _CLASSES:

        def pre(self, mesh, outer_size=None, outer_stride=None, module=None, mp_policy=None):
            dtype = mp_policy.param_dtype if mp_policy is not None else None
            return (self._tensor.to(dtype or self._tensor.dtype),), None

        def post(self, outputs, metadata, param_dtype, *, out=None):
            (data,) = outputs
            if out is not None:
                return None
            return data, (data,)

        _CLASSES[name] = type(
            name, (base,), {"fsdp_pre_all_gather": pre, "fsdp_post_all_gather": post}
        )
    return _CLASSES[name]


def record_fsdp_owners(model: nn.Module) -> None:
    """Note on each FP8 layer the FSDP2 parameter group that holds its weight (gather_in_bf16
    resets that group's buffers). Called once the model is sharded."""
    for module in model.modules():
        state_fn = getattr(module, "_get_fsdp_state", None)
        if state_fn is None:
            continue
        group = state_fn()._fsdp_param_group
        if group is None:
            continue
        for layer in module.modules():
            if is_fp8_linear(layer) and any(
                p.sharded_param is layer.weight for p in group.fsdp_params
            ):
                layer._fsdp_owner = group


# --- tensor parallelism ------------------------------------------------------------------------


def fp8_tp_styles() -> dict[str, type]:
    """torchao's float8 colwise/rowwise styles (input all-gathered and output gradient cast in
    FP8), bypassed by a layer whose `fp8` switch is off, which then runs as under torch's."""
    if "colwise" not in _CLASSES:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
        from torchao.float8.float8_tensor_parallel import (
            Float8ColwiseParallel,
            Float8RowwiseParallel,
        )

        def switched(fp8_style: type, plain: type) -> type:
            def prepare_input(input_layouts, desired_input_layouts, mod, inputs, device_mesh):
                style = fp8_style if mod.fp8 else plain
                return style._prepare_input_fn(
                    input_layouts, desired_input_layouts, mod, inputs, device_mesh
                )

            def prepare_output(output_layouts, use_local_output, mod, outputs, device_mesh):
                style = fp8_style if mod.fp8 else plain
                return style._prepare_output_fn(
                    output_layouts, use_local_output, mod, outputs, device_mesh
                )

            return type(
                f"Switched{fp8_style.__name__}",
                (fp8_style,),
                {
                    "_prepare_input_fn": staticmethod(prepare_input),
                    "_prepare_output_fn": staticmethod(prepare_output),
                },
            )

        bytes_for_gloo()
        _CLASSES["colwise"] = switched(Float8ColwiseParallel, ColwiseParallel)
        _CLASSES["rowwise"] = switched(Float8RowwiseParallel, RowwiseParallel)
    return {"colwise": _CLASSES["colwise"], "rowwise": _CLASSES["rowwise"]}


def bytes_for_gloo() -> None:
    """FP8 tensors through gloo's collectives as their bytes: gloo has no float8 types, so the
    all-gathers of torchao's float8 styles (and their waits) on CPU tensors move the data as
    uint8 (the same bytes NCCL moves) and view it back as FP8 afterwards. CUDA tensors take
    torchao's own path. Installed once, when a float8 style is first made."""
    from torchao.float8 import float8_ops
    from torchao.float8.float8_training_tensor import Float8TrainingTensor

    table = float8_ops.FLOAT8_OPS_TABLE
    gathers = [
        torch.ops.c10d_functional.all_gather_into_tensor.default,
        torch.ops._c10d_functional.all_gather_into_tensor.default,
    ]
    waits = [
        torch.ops.c10d_functional.wait_tensor.default,
        torch.ops._c10d_functional.wait_tensor.default,
    ]
    if getattr(table[gathers[1]], "bigtrain_bytes", False):
        return
    torchao_gather, torchao_wait = table[gathers[1]], table[waits[1]]

    def wrap(t: Any, data: torch.Tensor) -> Any:
        return Float8TrainingTensor(
            data, t._scale, t._orig_dtype, t._linear_mm_config, t._gemm_input_role
        )

    def gather(aten_op, args, kwargs=None):
        t = args[0]
        if t._data.device.type != "cpu":
            return torchao_gather(aten_op, args, kwargs)
        out = wrap(t, aten_op(t._data.contiguous().view(torch.uint8), *args[1:], **(kwargs or {})))
        out.fp8_dtype = t._data.dtype
        return out

    def wait(aten_op, args, kwargs=None):
        t = args[0]
        dtype = getattr(t, "fp8_dtype", None)
        if dtype is None:
            return torchao_wait(aten_op, args, kwargs)
        return wrap(t, aten_op(t._data, *args[1:], **(kwargs or {})).view(dtype))

    gather.bigtrain_bytes = True
    for op in gathers:
        table[op] = gather
    for op in waits:
        table[op] = wait


def uses_fp8_tp_styles(module: nn.Module) -> bool:
    """FP8 layers of the tensorwise recipe on GPUs take torchao's float8 styles; rowwise recipes
    keep torch's (torchao's styles assume one scale per tensor), under which Float8Linear casts
    the DTensor shards itself, with the amax reduced over the tp ranks. So do CPU tensors: there
    the float8 styles' backward fails in torch._scaled_mm ("Invalid scaling configuration",
    torchao 0.18 on gloo), so CPU runs test the FP8 matmuls under tensor parallelism, not the FP8
    all-gather of the inputs."""
    if not is_fp8_linear(module) or module.weight.device.type == "cpu":
        return False
    from torchao.float8.config import ScalingGranularity

    return module.config.cast_config_input.scaling_granularity is ScalingGranularity.TENSORWISE
