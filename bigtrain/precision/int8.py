"""INT8 forward for linear layers: INT8 matmuls forward, BF16 gradients against the master weights.

Forward of a converted layer, y = x W^T + b:
  1. smoothing (after calibration): x' = x / s, W' = W * s per input channel k, with
     s_k = amax(x_k)^a / amax(W_k)^(1-a) (SmoothQuant). Exact in real arithmetic; it moves
     activation outliers into the weights, where per-channel scales absorb them.
  2. W' quantized symmetric per output channel: q_w = round(W' / s_w), s_w = amax_row / 127.
  3. x' quantized per token (row): symmetric, q_x = round(x' / s_x), s_x = amax_row / 127; or
     affine, q_x = round(x' / s_x) + z_x with s_x = (max - min) / 255 over a range holding 0.
  4. acc = q_x q_w^T in INT32 (`torch._int_mm` where the platform has it; else the same integers
     multiplied in FP32, logged once), y = s_x s_w (acc - z_x colsum(q_w)) + b.
Backward (straight-through estimator: quantizers pass gradients unchanged), in the compute dtype:
  dx = dy W (the master weights, not their INT8 copy), dW = dy^T x_hat, db = sum dy,
where x_hat is the dequantized input. Only q_x (1 byte per value) and its per-token scales are
saved for backward, not the BF16 input (2 bytes): the activation memory of linear inputs halves.

Error bound of the forward (what tests check): per value |x' - x_hat'| <= s_x / 2 and
|W' - W_hat'| <= s_w / 2, so per output |y - y_hat| <= s_x/2 sum_k |W'_jk| + s_w_j/2 sum_k |x_hat'_k|.

Calibration: during the first `calibration_steps` optimizer steps each layer records the running
max |x_k| per input channel (reduced with MAX across ranks once per step); then the smoothing
scales are fixed, or follow an EMA of later steps. The state travels with checkpoints and
snapshots (`Int8Calibration.state_dict`).

Tensor parallelism: `Int8Linear` is an `nn.Linear`, so torch's ColwiseParallel/RowwiseParallel
split it like the layer it replaces; its forward then runs on the local shards, with the scales
that span tp ranks MAX-reduced over them, so the grid is the single-process one (int8_tp.py).
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from bigtrain.config.schema import Int8Config
from bigtrain.errors import ConfigError
from bigtrain.model.hf import HFCausalLM
from bigtrain.model.hf_routers import router_modules
from bigtrain.precision.int8_tp import (
    Split,
    all_reduce_max,
    input_columns,
    local_input,
    local_output,
    tp_split,
)
from bigtrain.utils.names import ancestors, canonical_name
from bigtrain.utils.tensors import autocast_dtype, autocast_off, full_shape, local_tensor

logger = logging.getLogger(__name__)

EPS = 1e-12


def quantize_rows_symmetric(
    t: torch.Tensor, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values and FP32 scales (one per row) with t ~= q * scale[:, None]; |error| <= scale/2.
    amax: max |t| per row, where the row spans more than `t` (its columns split over ranks)."""
    t = t.float()
    amax = t.abs().amax(dim=-1) if amax is None else amax
    scale = amax.clamp_min(EPS) / 127.0
    q = torch.round(t / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def quantize_rows_affine(
    t: torch.Tensor, low: torch.Tensor | None = None, high: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int8 values, FP32 scales and int32 zero points per row: t ~= (q - zero) * scale[:, None].
    The range always holds 0, so zero padding and ReLU zeros stay exact; |error| <= scale/2.
    low, high: min and max per row (<= 0 and >= 0), where the row spans more than `t`."""
    t = t.float()
    low = t.amin(dim=-1).clamp_max(0.0) if low is None else low
    high = t.amax(dim=-1).clamp_min(0.0) if high is None else high
    scale = (high - low).clamp_min(EPS) / 255.0
    zero = (torch.round(-low / scale) - 128).to(torch.int32)
    q = (torch.round(t / scale[:, None]) + zero[:, None]).clamp_(-128, 127).to(torch.int8)
    return q, scale, zero


def quantize_operands(
    x2: torch.Tensor, w32: torch.Tensor, affine: bool, mesh: DeviceMesh | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """q_w, s_w, q_x, s_x, z_x of (tokens, in) inputs and (out, in) weights. mesh: the tp ranks
    over which `in` is split (rowwise); the row ranges are then MAX-reduced, in one collective,
    to those of the whole rows."""
    w_amax = w32.abs().amax(dim=1)
    if affine:  # max and -min, both >= 0: one MAX reduces both
        x_ranges = torch.stack([x2.amax(dim=1).clamp_min(0.0), (-x2.amin(dim=1)).clamp_min(0.0)])
    else:
        x_ranges = x2.abs().amax(dim=1)[None]
    ranges = all_reduce_max(torch.cat([w_amax, x_ranges.flatten()]), mesh)
    w_amax, x_ranges = ranges[: w32.shape[0]], ranges[w32.shape[0] :].view(-1, x2.shape[0])
    qw, sw = quantize_rows_symmetric(w32, w_amax)
    if affine:
        qx, sx, zx = quantize_rows_affine(x2, low=-x_ranges[1], high=x_ranges[0])
    else:
        (qx, sx), zx = quantize_rows_symmetric(x2, x_ranges[0]), None
    return qw, sw, qx, sx, zx


def dequantize_rows(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None
) -> torch.Tensor:
    values = q.float() if zero is None else q.float() - zero[:, None].float()
    return values * scale[:, None]


_FALLBACK_LOGGED: set[str] = set()
_int_mm_ok: dict[str, bool] = {}


def log_fallback_once(reason: str) -> None:
    if reason not in _FALLBACK_LOGGED:
        _FALLBACK_LOGGED.add(reason)
        logger.warning("int8: %s; the INT8 products are summed in FP32 instead", reason)


def int_mm_available(device: torch.device) -> bool:
    """Whether torch._int_mm runs on this device type: probed once, at setup (a probe inside a
    compiled forward would break the graph), with a valid shape; a failure is logged."""
    if device.type not in _int_mm_ok:
        try:
            a = torch.ones(32, 32, dtype=torch.int8, device=device)
            _int_mm_ok[device.type] = bool((torch._int_mm(a, a.t()) == 32).all())  # host sync
        except (RuntimeError, NotImplementedError):
            _int_mm_ok[device.type] = False
        if not _int_mm_ok[device.type]:
            log_fallback_once(f"torch._int_mm does not run on {device.type}")
    return _int_mm_ok[device.type]


def int8_matmul(qx: torch.Tensor, qw: torch.Tensor) -> torch.Tensor:
    """qx (M, K) int8 times qw (N, K)^T -> (M, N) int32, exactly where torch._int_mm runs."""
    m, k = qx.shape
    n = qw.shape[0]
    if not _int_mm_ok.get(qx.device.type, False):
        pass  # logged by int_mm_available at setup
    elif qx.device.type == "cuda" and not (m > 16 and k % 8 == 0 and n % 8 == 0):
        # cuBLASLt's INT8 kernels need M > 16 and K, N multiples of 8.
        log_fallback_once(f"a {m}x{k}x{n} matmul does not meet _int_mm's CUDA shape rules")
    else:
        return torch._int_mm(qx, qw.t())
    # Exact while k * 127 * 128 < 2**24 (k < 1032); beyond, FP32 rounding of the sums adds error.
    # Out of place: selective checkpointing may cache the matmul's output.
    return torch.round(qx.float() @ qw.float().t()).to(torch.int32)


class Int8LinearFunction(torch.autograd.Function):
    """y = x W^T + b, INT8 forward and STE backward (module docstring). mesh: the tp ranks over
    which the input features are split (rowwise); the output is then a partial sum, which holds
    the bias on tp rank 0 only, and the gradients are those of the local shards."""

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        smooth: torch.Tensor | None,
        affine: bool,
        transposed: bool,
        mesh: DeviceMesh | None,
    ) -> torch.Tensor:
        device_type = x.device.type
        out_dtype = autocast_dtype(device_type) or x.dtype
        with autocast_off(device_type):
            w = weight.t() if transposed else weight  # (out, in)
            x2 = x.reshape(-1, x.shape[-1]).float()
            w32 = w.float()
            if smooth is not None:
                x2, w32 = x2 / smooth, w32 * smooth
            qw, sw, qx, sx, zx = quantize_operands(x2, w32, affine, mesh)
            y = int8_matmul(qx, qw).float()
            if zx is not None:  # the zero points' share, a rank-1 term: sum_k z q_w = z colsum
                y.addr_(zx.float(), qw.sum(dim=1, dtype=torch.int32).float(), alpha=-1)
            y.mul_(sw).mul_(sx[:, None])  # in place: the output is the largest tensor here
            if bias is not None and (mesh is None or mesh.get_local_rank() == 0):
                y = y + bias.float()
        ctx.save_for_backward(qx, sx, zx, smooth, weight)
        ctx.affine, ctx.transposed, ctx.compute_dtype = affine, transposed, out_dtype
        ctx.has_bias, ctx.x_shape = bias is not None, x.shape
        return y.to(out_dtype).reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        qx, sx, zx, smooth, weight = ctx.saved_tensors
        dtype = ctx.compute_dtype
        with autocast_off(grad_out.device.type):
            dy = grad_out.reshape(-1, grad_out.shape[-1]).to(dtype)
            w = (weight.t() if ctx.transposed else weight).to(dtype)  # (out, in)
            grad_x = grad_w = grad_b = None
            if ctx.needs_input_grad[0]:
                grad_x = (dy @ w).reshape(ctx.x_shape)
            if ctx.needs_input_grad[1]:
                x_hat = dequantize_rows(qx, sx, zx)
                if smooth is not None:
                    x_hat = x_hat * smooth
                grad_w = dy.t() @ x_hat.to(dtype)  # (out, in)
                if ctx.transposed:
                    grad_w = grad_w.t()
                grad_w = grad_w.to(weight.dtype)
            if ctx.has_bias and ctx.needs_input_grad[2]:
                grad_b = dy.float().sum(dim=0)
        return grad_x, grad_w, grad_b, None, None, None, None


class Int8Layer(nn.Module):
    """Stands in for an `nn.Linear` (weight (out, in)) or a transformers `Conv1D` (weight
    (in, out)), holding the same Parameter objects, so names, ties and shards are unchanged."""

    def __init__(self, source: nn.Module, transposed: bool, affine: bool) -> None:
        nn.Module.__init__(self)  # not super(): Int8Linear's next base is nn.Linear
        self.weight = source.weight
        self.bias = source.bias
        for key, value in vars(source).items():  # e.g. in_features, residual_scaled_init
            if not key.startswith("_") and key not in vars(self) and not callable(value):
                setattr(self, key, value)
        self.transposed, self.affine = transposed, affine
        in_features = full_shape(self.weight)[0 if transposed else 1]  # also partitioned (ZeRO-3)
        self.in_features = in_features
        self.observe = True  # record max |x| per input channel (calibration, EMA)
        self.smoothing_alpha = 0.5
        self.smoothing = False  # set once calibration is complete
        # The calibrated and this step's max |x| per input channel; not in the model's state_dict:
        # Int8Calibration carries them in the trainer state (checkpoints and snapshots). Buffers on
        # the weight's device: they move with the module, and a layer converted after the model
        # went to the GPU has them there too. Tensor parallelism makes them replicated DTensors
        # (whole vectors): read them through local_tensor.
        device = self.weight.device
        self.register_buffer("act_amax", torch.zeros(in_features, device=device), persistent=False)
        self.register_buffer("step_amax", torch.zeros(in_features, device=device), persistent=False)

    def extra_repr(self) -> str:
        kind = "affine" if self.affine else "symmetric"
        return f"in={self.in_features}, activations={kind} per token, weights=symmetric per channel"

    def smooth_scales(
        self,
        weight: torch.Tensor | None = None,
        columns: slice = slice(None),
        mesh: DeviceMesh | None = None,
    ) -> torch.Tensor | None:
        """SmoothQuant's s per input channel (None before calibration). Under tensor parallelism:
        `weight` the local shard, `columns` the input channels it holds, `mesh` the tp ranks
        that hold the other rows (colwise: max |W| per input channel is a MAX over them)."""
        if not self.smoothing:
            return None
        w = (self.weight if weight is None else weight).detach().float()
        w_amax = w.abs().amax(dim=1) if self.transposed else w.abs().amax(dim=0)
        w_amax = all_reduce_max(w_amax, mesh).clamp_min(EPS)
        a = self.smoothing_alpha
        s = local_tensor(self.act_amax)[columns].float().clamp_min(EPS).pow(a) / w_amax.pow(1 - a)
        return s.clamp(1e-4, 1e4)

    def observe_input(self, x: torch.Tensor, columns: slice = slice(None)) -> None:
        """Fold max |x| per input channel into this step's (`columns`: those x holds)."""
        if self.observe and self.training and torch.is_grad_enabled():
            amax = x.detach().abs().reshape(-1, x.shape[-1]).amax(dim=0).float()
            step_amax = local_tensor(self.step_amax)[columns]
            step_amax.copy_(torch.maximum(step_amax, amax))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        split = tp_split(self.weight)
        if split is not None:
            return self.forward_local(x, split)
        self.observe_input(x)
        return Int8LinearFunction.apply(
            x, self.weight, self.bias, self.smooth_scales(), self.affine, self.transposed, None
        )

    def forward_local(self, x: torch.Tensor, split: Split) -> torch.Tensor:
        """Under tensor parallelism (see int8_tp): the INT8 forward of the local shards, with
        the scales that span tp ranks reduced over them, as the DTensor the style expects."""
        assert not self.transposed, "tensor parallelism splits nn.Linear layers only"
        mesh, rowwise = self.weight.device_mesh, split == "rowwise"
        x_local, weight = local_input(x, split), self.weight.to_local()
        columns = input_columns(self.weight) if rowwise else slice(None)
        self.observe_input(x_local, columns)
        smooth = self.smooth_scales(weight, columns, None if rowwise else mesh)
        # Rowwise: the bias is replicated, and its gradient (sum dy, dy whole) the same everywhere.
        bias = None if self.bias is None else self.bias.to_local()
        y = Int8LinearFunction.apply(
            x_local, weight, bias, smooth, self.affine, False, mesh if rowwise else None
        )
        return local_output(y, mesh, split)


class Int8Linear(Int8Layer, nn.Linear):
    """An Int8Layer over an `nn.Linear`, itself an `nn.Linear`: tensor parallelism's plan picks
    it, and torch's ColwiseParallel/RowwiseParallel distribute it, as the layer it replaces."""

    def __init__(self, source: nn.Linear, transposed: bool = False, affine: bool = True) -> None:
        assert not transposed, "a transposed (Conv1D) weight is an Int8Layer"
        super().__init__(source, transposed=False, affine=affine)


def _linear_kind(module: nn.Module) -> bool | None:
    """False for nn.Linear, True for a transformers Conv1D (transposed weight), None otherwise."""
    if isinstance(module, Int8Layer):
        return None  # converted already
    if isinstance(module, nn.Linear):
        return False
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        return True
    return None


def convert_to_int8(
    model: nn.Module, cfg: Int8Config, fp32_patterns: tuple[str, ...] = ()
) -> dict[str, Int8Layer]:
    """Replace the linear layers that `cfg.modules` selects and `cfg.exclude` does not by
    Int8Linear (a Conv1D by an Int8Layer), in place. Returns them by canonical name. Call before
    sharding and wrapping."""
    if cfg.weight_scheme != "symmetric":
        raise ConfigError(
            f"precision.int8.weight_scheme got {cfg.weight_scheme!r}, expected symmetric "
            "(per output channel)"
        )
    candidates, routes = [], token_routers(model)
    for name, module in model.named_modules():
        cname = canonical_name(name)
        transposed = _linear_kind(module)
        if transposed is None or not cname:
            continue
        if not any(fnmatch.fnmatchcase(cname, p) for p in cfg.modules):
            continue
        if any(fnmatch.fnmatchcase(cname, p) for p in cfg.exclude):
            continue
        if routes(name):  # its logits choose the experts: left out, as by FP8
            continue
        inside_fp32 = [
            p for p in fp32_patterns if any(fnmatch.fnmatchcase(a, p) for a in ancestors(cname))
        ]
        if inside_fp32:
            raise ConfigError(
                f"precision.int8.modules selects '{cname}', which precision.fp32_modules "
                f"('{inside_fp32[0]}') keeps in FP32; exclude it with precision.int8.exclude"
            )
        candidates.append((name, cname, module, transposed))
    if not candidates:
        raise ConfigError(
            f"precision.int8.modules {list(cfg.modules)} (minus precision.int8.exclude "
            f"{list(cfg.exclude)}) selects no linear layer of the model"
        )
    converted = {}
    for name, cname, module, transposed in candidates:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        kind = Int8Layer if transposed else Int8Linear
        layer = kind(module, transposed, affine=cfg.activation_scheme == "affine")
        layer.smoothing_alpha = cfg.smoothing_alpha
        layer.observe = cfg.calibration_steps > 0
        setattr(parent, child, layer)
        converted[cname] = layer
    return converted


def token_routers(model: nn.Module) -> Callable[[str], bool]:
    """Whether module `name` of `model` is (in) an MoE router: a linear layer beside a layer's
    experts (a family's gate), or inside the router class a transformers family declares
    (model/hf_routers.py, found once here). INT8 and FP8 leave them out whatever the patterns
    say."""
    owner = model.hf if isinstance(model, HFCausalLM) else None
    routers = [f"hf.{n}" for n, _ in router_modules(owner)] if owner is not None else []

    def routes(name: str) -> bool:
        parent_name = name.rpartition(".")[0]
        parent = model.get_submodule(parent_name) if parent_name else model
        return hasattr(parent, "experts") or any(
            name == r or name.startswith(r + ".") for r in routers
        )

    return routes
