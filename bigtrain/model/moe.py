"""Mixture-of-experts MLP for bigtrain's GPT (model.moe; docs/moe.md).

A router (an FP32 island: logits, scores and top-k in FP32 whatever the compute dtype) sends each
token to `top_k` of `experts` MLPs; their outputs are summed with the router's weights. The
token-expert pairs are sorted by expert and each expert multiplies its run of tokens at once
(`grouped_mm`: torch._grouped_mm on GPUs that have it, one matmul per expert elsewhere), so no
Python loop ever runs over tokens. Dropless by default; with a capacity factor the pairs beyond an
expert's capacity are dropped (earliest tokens kept) and counted.

Two losses keep the router healthy: the load-balancing loss (Switch Transformer) and the router
z-loss (ST-MoE). They do not travel to the training loss through the model's output: each MoE
layer attaches its weighted losses to its own output with `AttachAux`, whose backward hands them
the gradient the language-model loss gets (its loss scale over the micro-batches). So they reach
the weights on every backend, across pipeline stages and through activation checkpointing, as if
added to the loss. That factor is the step's, not the model's: a backend runs each micro-batch's
forward and backward inside `aux_grad_scale(model, factor)`, and a backward whose forward ran
without one raises rather than train the routers with a wrong gradient.

Under expert parallelism (parallel/experts.py sets `ep_group`) each rank holds
experts / ep of them; the sorted pairs are sent to the rank that holds their expert and back
with all-to-all.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from bigtrain.config.model import MoEConfig
from bigtrain.utils.tensors import autocast_off, local_tensor

STATS_EXTRA = 4
"""Per MoE layer, after its per-expert loads: aux loss, z-loss, dropped pairs, forwards, then per
expert the standard deviation of its score over a forward's tokens (the sums over a step's
micro-batches that `stats` holds: 2 x experts + STATS_EXTRA numbers)."""

MISSING_AUX_GRAD_SCALE = (
    "an MoE layer's backward has no aux_grad_scale for its auxiliary losses: run each training "
    "forward and its backward inside bigtrain.model.moe.aux_grad_scale(model, factor), factor "
    "being what the loss is multiplied by before backward (the loss scale / micro-batches)"
)


@contextlib.contextmanager
def aux_grad_scale(model: nn.Module, factor: float) -> Iterator[None]:
    """Around one micro-batch's forward and backward of `model`: the factor its loss is
    multiplied by before backward (the loss scale over the micro-batches), which the MoE layers'
    auxiliary losses get as their gradient. Each training forward takes it to its backward."""
    layers = [m for m in model.modules() if isinstance(m, AuxLosses)]
    previous = [layer.aux_grad_scale for layer in layers]
    for layer in layers:
        layer.aux_grad_scale = factor
    try:
        yield
    finally:
        for layer, value in zip(layers, previous, strict=True):
            layer.aux_grad_scale = value


class AuxLosses:
    """A module whose training forward attaches auxiliary losses to its output (`AttachAux`):
    bigtrain's MoE layers, and a transformers MoE family's load-balancing loss (model/hf.py).
    `aux_grad_scale` sets their factor around each micro-batch."""

    aux_grad_scale: float | None = None
    """The gradient of the auxiliary losses, set by `aux_grad_scale` for one micro-batch."""


class AttachAux(torch.autograd.Function):
    """`out` unchanged; in backward, `aux` (a weighted loss) gets the gradient the training loss
    gets: `scale`, the step's aux_grad_scale when the forward ran (None: none was given, and
    backward raises). So aux behaves as a term of the loss without being returned."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, out: torch.Tensor, aux: torch.Tensor, scale: float | None
    ) -> torch.Tensor:
        ctx.scale = scale
        return out

    @staticmethod
    def backward(  # type: ignore[override]
        ctx, grad: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, None]:
        if ctx.scale is None:
            raise RuntimeError(MISSING_AUX_GRAD_SCALE)
        return grad, torch.full((), ctx.scale, device=grad.device, dtype=torch.float32), None


class Routing(NamedTuple):
    weights: torch.Tensor  # (tokens, k) FP32: each chosen expert's share of the output
    experts: torch.Tensor  # (tokens, k) int64
    load: torch.Tensor  # (experts,) token-expert pairs routed to each, before any capacity drop
    aux: torch.Tensor  # load-balancing loss (1.0 when balanced)
    z: torch.Tensor  # router z-loss
    importance: torch.Tensor  # (experts,) FP32: the mean normalised score of each expert
    score_std: torch.Tensor  # (experts,) FP32: the standard deviation of that score over tokens


def route(
    logits: torch.Tensor,
    k: int,
    score: str,
    normalize: bool,
    sequence: tuple[dist.ProcessGroup, int] | None = None,
) -> Routing:
    """Top-k routing of FP32 router logits (tokens, experts). `sequence`: the group and number
    of the cp ranks that hold the other tokens of the same sequences (context parallelism,
    MoE.sequence): the load-balancing loss
    counts the loads of all of them, so the mean of their losses is the whole sequences' (its
    gradient flows through each rank's own mean probabilities only, as without them)."""
    n_experts = logits.shape[-1]
    scores = logits.softmax(-1) if score == "softmax" else logits.sigmoid()
    weights, experts = scores.topk(k, dim=-1)
    if normalize:
        weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-20)
    load = torch.bincount(experts.flatten(), minlength=n_experts)
    # Switch Transformer: E x sum_e (share of pairs routed to e) x (mean probability of e).
    probs = scores if score == "softmax" else scores / scores.sum(-1, keepdim=True)
    importance = probs.mean(0)
    shares = load.float() / experts.numel()
    if sequence is not None:  # on the device: no host sync
        group, ranks = sequence
        shares = shares / ranks
        dist.all_reduce(shares, group=group)
    aux = n_experts * (shares * importance).sum()
    z = torch.logsumexp(logits, dim=-1).square().mean()
    spread = probs.detach().std(0, correction=0)
    return Routing(weights, experts, load, aux, z, importance.detach(), spread)


def dispatch_order(
    experts: torch.Tensor, n_experts: int, capacity: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The token-expert pairs (flat indices into experts.flatten()) sorted by expert (stable: in
    token order within an expert), and the pairs each expert takes. With a `capacity`, an
    expert's pairs beyond it are left out."""
    flat = experts.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=n_experts)
    if capacity is None:
        return order, counts
    starts = counts.cumsum(0) - counts
    place = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
    return order[place < capacity], counts.clamp(max=capacity)


def uses_grouped_kernel(device: torch.device, dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
    """torch._grouped_mm for weights of `shape` (experts, in, out): CUDA devices of compute
    capability 9.0 and up in BF16; CPUs in FP32 or BF16. Rows of 16-byte multiples only."""
    if not hasattr(torch, "_grouped_mm") or any(n * dtype.itemsize % 16 for n in shape[1:]):
        return False
    if device.type == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device)[0] >= 9
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows of `x` (grouped: counts[e] rows for expert e, in order) times w[e] (experts, in,
    out), in the autocast dtype when autocast is on. One grouped kernel where the device has it
    (no host read; on a CPU also the fast path in BF16, where one matmul per expert pays
    oneDNN's set-up for every new row count), else one matmul per expert."""
    dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled() else x.dtype
    if uses_grouped_kernel(x.device, dtype, tuple(w.shape)):
        offsets = counts.cumsum(0).to(torch.int32)
        return torch._grouped_mm(x.to(dtype), w.to(dtype), offs=offsets)
    return per_expert_mm(x, w, counts)


def per_expert_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """grouped_mm as one matmul per expert, from the counts on the host (one read per call).
    unbind, not w[e]: its backward stacks the experts' gradients once, where indexing would add
    a zero-filled copy of the whole stack per expert."""
    parts = x.split(counts.tolist())
    return torch.cat([part @ w_e for part, w_e in zip(parts, w.unbind(0), strict=True)])


class Experts(nn.Module):
    """`n` MLPs as stacked weights (n, in, out): w_gate and w_up (SwiGLU) or w_up (GELU), then
    w_down. Under expert parallelism the parameters are DTensors split by expert (dim 0)."""

    def __init__(self, n: int, d_model: int, hidden: int, swiglu: bool) -> None:
        super().__init__()
        self.w_gate = nn.Parameter(torch.empty(n, d_model, hidden)) if swiglu else None
        self.w_up = nn.Parameter(torch.empty(n, d_model, hidden))
        self.w_down = nn.Parameter(torch.empty(n, hidden, d_model))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: rows grouped by this rank's experts, counts[e] rows for each."""
        up = grouped_mm(x, local_tensor(self.w_up), counts)
        if self.w_gate is not None:
            h = F.silu(grouped_mm(x, local_tensor(self.w_gate), counts)) * up
        else:
            h = F.gelu(up, approximate="tanh")
        return grouped_mm(h, local_tensor(self.w_down), counts)


class Router(nn.Module):
    """The router's weight (experts, d_model). Not an nn.Linear: it is an FP32 island that no
    layer replacement (INT8 forward) or compute-dtype cast may touch; MoE computes its logits."""

    def __init__(self, d_model: int, experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, d_model))


class MoE(nn.Module, AuxLosses):
    """The MLP of an MoE block: router, routed experts, optional shared expert."""

    def __init__(
        self, cfg: MoEConfig, d_model: int, hidden: int, swiglu: bool, shared: nn.Module | None
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.router = Router(d_model, cfg.experts)
        self.experts = Experts(cfg.experts, d_model, hidden, swiglu)
        self.shared = shared
        self.ep_group: dist.ProcessGroup | None = None
        """Set by expert parallelism: the ranks this layer's experts are split over."""
        self.sequence: tuple[dist.ProcessGroup, int] | None = None
        """Set by context parallelism: the group and number of the ranks holding the other
        chunks of each sequence (`route`'s load-balancing loss counts their loads too)."""
        self.router_bias: torch.Tensor | None = None
        """Added to the router logits when set (the `drill.router_bias` drill)."""
        self.aux_grad_scale: float | None = None
        """The gradient of the auxiliary losses, set by `aux_grad_scale` for one micro-batch."""
        width = 2 * cfg.experts + STATS_EXTRA
        self.register_buffer("stats", torch.zeros(width), persistent=False)
        """Sums over the step's training forwards: load per expert, aux, z, dropped, forwards,
        score standard deviation per expert."""
        self.register_buffer("extremes", torch.zeros(2 * cfg.experts), persistent=False)
        """Over the step's training forwards, per expert: the largest importance (mean score) of
        one forward, then 1 - the smallest: a MAX over forwards and ranks keeps both, and zeros
        (no forward) change neither (monitor/routers.py)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        with autocast_off(x.device.type):  # the FP32 island (FP64 stays FP64)
            wide = torch.promote_types(flat.dtype, torch.float32)
            logits = flat.to(wide) @ local_tensor(self.router.weight).to(wide).t()
            if self.router_bias is not None:
                logits = logits + self.router_bias
            r = route(
                logits,
                self.cfg.top_k,
                self.cfg.score,
                self.cfg.normalize_weights,
                self.sequence if self.training else None,
            )
        capacity = self.capacity(flat.shape[0])
        order, counts = dispatch_order(r.experts, self.cfg.experts, capacity)
        token = order // self.cfg.top_k
        if self.ep_group is None:
            y = self.experts(flat[token], counts)
        else:
            y = expert_parallel(self.experts, flat[token], counts, self.ep_group)
        # Back to (token, slot) places, then the weighted sum over each token's k slots: no
        # scatter-add, so the sum's order (and the result) is the same on every device.
        slots = y.new_zeros(r.experts.numel(), shape[-1]).index_copy(0, order, y)
        weights = r.weights.flatten().to(y.dtype).unsqueeze(-1)
        out = (slots * weights).view(flat.shape[0], self.cfg.top_k, -1).sum(1)
        losses = self.cfg.aux_loss_coef * r.aux + self.cfg.z_loss_coef * r.z
        if losses.requires_grad:
            out = AttachAux.apply(out, losses, self.aux_grad_scale)
        if recording(self):
            self._record(r, r.experts.numel() - order.numel())
        if self.shared is not None:
            out = out + self.shared(flat)
        return out.view(shape)

    def capacity(self, tokens: int) -> int | None:
        """Pairs per expert kept in a training forward; None: all (dropless, and always in
        evaluation and generation, where a token's output must not depend on its batch)."""
        if self.cfg.capacity_factor <= 0 or not self.training:
            return None
        return math.ceil(self.cfg.capacity_factor * tokens * self.cfg.top_k / self.cfg.experts)

    def _record(self, r: Routing, dropped: int) -> None:
        record_routing(self.stats, self.extremes, r, dropped)


def recording(module: nn.Module) -> bool:
    """Whether a router's forward is one whose routing the monitor counts: a training forward,
    not its recomputation in backward (activation checkpointing: backward runs inside a graph
    task)."""
    return module.training and torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1


@torch.no_grad()
def record_routing(stats: torch.Tensor, extremes: torch.Tensor, r: Routing, dropped: int) -> None:
    """One forward's routing into an MoE layer's `stats` and `extremes` (their layout:
    STATS_EXTRA, MoE's buffers; monitor/routers.py reads them). No host sync."""
    n = r.load.numel()
    stats[:n] += r.load
    stats[n] += r.aux
    stats[n + 1] += r.z
    stats[n + 2 : n + 4] += torch.as_tensor([float(dropped), 1.0], device=stats.device)
    stats[n + 4 :] += r.score_std
    both = torch.cat([r.importance, 1.0 - r.importance]).to(extremes.dtype)
    torch.maximum(extremes, both, out=extremes)


def expert_parallel(
    experts: Experts, x: torch.Tensor, counts: torch.Tensor, group: dist.ProcessGroup
) -> torch.Tensor:
    """`experts` split over `group` (this rank holds a run of experts / ep of them): the rows of
    x (grouped by global expert, counts per expert) go to their expert's rank, through it, and
    back, in x's order. Two all-to-alls of rows (dispatch, combine; differentiable) and one of
    the counts, read on the host for the split sizes."""
    ep = dist.get_world_size(group)
    local = counts.numel() // ep
    send = counts.view(ep, local)  # rows for each rank's experts
    recv = torch.empty_like(send)  # recv[src, e]: rank src's rows for this rank's expert e
    dist.all_to_all_single(recv, send.contiguous(), group=group)
    sizes = torch.stack([send.sum(1), recv.sum(1)]).tolist()  # one host read
    rows = funcol.all_to_all_single_autograd(x, sizes[1], sizes[0], group)
    # Received by (source, expert): regroup by expert for the matmuls, then back.
    expert_of = torch.arange(local, device=x.device).repeat(ep).repeat_interleave(recv.flatten())
    by_expert = expert_of.argsort(stable=True)
    y = experts(rows[by_expert], recv.sum(0))
    y = y.new_empty(y.shape).index_copy(0, by_expert, y)
    return funcol.all_to_all_single_autograd(y, sizes[0], sizes[1], group)


def moe_layers(model: nn.Module) -> list[MoE]:
    """The MoE layers of a model (or pipeline chunk) in module order."""
    return [m for m in model.modules() if isinstance(m, MoE)]
