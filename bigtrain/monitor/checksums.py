"""Gradient checksums: each covered gradient checked against what its layer's inputs and output
gradients say it must be (algorithm-based fault tolerance, Huang and Abraham 1984).

The suspicion tier (resilience/suspicion.py) reads magnitudes only, against each tensor's own
history. Early in a run that history is short and wild: healthy tensors move 7-400x from step to
step while attention and the norms wake up, so a corrupted tensor's x10 looks like its neighbours'
healthy moves (docs/healing.md). A checksum needs no history. For a linear layer the weight's
gradient is dW = dYᵀX over the step's tokens, so for fixed random ±1 vectors R (PROBES of them)

    dW·R = dYᵀ(X·R)

The right side costs two thin matrix products per layer, computed by hooks as the step runs
(X·R in forward, PROBES numbers per token; dYᵀ(X·R) in backward); the left side one per
gradient, after the gradients are reduced. A gradient that a fault scaled, or a bit flip moved,
no longer matches; rounding leaves them within about 1% of each other (BF16) and a x10 fault 90%
apart. Covered, per parameter (PROBES check values per row of a matrix, a vector checked whole):

- nn.Linear (and the tied output projection): weight dW·R = dYᵀ(X·R); bias db = Σ dY.
- nn.Embedding: dE·R = Σ_tokens onehot(id)·(dY·R) (an index_add). Tied to the output
  projection, both uses add into the one table's check vector.
- bigtrain's LayerNorm and RMSNorm: gain dg = Σ dY ⊙ x̂, x̂ recomputed in FP32 from the norm's
  input (which its backward keeps anyway); bias db = Σ dY.

Precision: every sum over tokens is taken in FP32 from the inputs as the matmul reads them
(autocast's rounding included), never rounded per token: a gradient is a sum of per-token terms
far larger than itself (their mean is what trains), so rounding each term would add up. With
PROBES probes (see there) the two sides of healthy BF16 tiny runs stay within 2% of each other.

Other parameters (MoE experts and routers, INT8 and FP8 linears, transformers models' own
modules) are left to the magnitude tiers; the run's start event lists the coverage. Each rank's
check vectors ride the monitor's SUM all-reduce with the observed side: the expected side is
each rank's own tokens' (averaged like the gradients), the observed one its gradient shard's rows
(weighted 1/replication under HSDP). A tensor's residual is the largest over its shard blocks of
|observed - expected| / max(|observed|, |expected|, a floor of FLOOR x the global gradient norm):
a fault on one rank's shard is judged on that shard's rows.

Supported layouts: one process (`local`, one stage) and FSDP2 / HSDP (`fsdp`) without tensor,
context, expert or pipeline parallelism, replica groups or compile; elsewhere the checksums are off
and the start event says why (`Coverage.reason`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils._python_dispatch import _disable_current_modes

from bigtrain.config.resilience import ChecksumConfig
from bigtrain.model.gpt import LayerNorm, RMSNorm, TiedLinear
from bigtrain.monitor.slots import Pack, Slot
from bigtrain.parallel.layout import Layout
from bigtrain.utils.names import canonical_name
from bigtrain.utils.tensors import autocast_dtype, autocast_off, local_block

OBSERVED, EXPECTED = "checksum_observed", "checksum_expected"
"""The slots: each covered gradient's check vector as read from it, and as its layer's inputs and
output gradients say it must be (both summed over ranks)."""
FLOOR = 1e-5
"""A block's difference is relative to at least this share of the global gradient norm: a
gradient whose exact value is 0 (attention's key bias) is rounding noise on both sides, whose
differences are not a fault's."""
PROBES = 4
"""Random ±1 vectors a matrix's gradient is checked along. With one, a gradient of low rank whose
row space lies nearly orthogonal to it (a layer whose input has one dominant direction) has a
check value far smaller than itself, and rounding of the order of the gradient's own becomes a
large share of it: a healthy BF16 residual of 0.1 in the tiny model. Four read the layer's input
and output gradient once each, as one does."""
SEED = 0x5EED
"""The probe vectors' generator seed: the same ±1 vectors on every rank and in every run."""
LINEAR_TYPES = (nn.Linear, TiedLinear)
NORM_TYPES = (LayerNorm, RMSNorm)


@dataclass
class Entry:
    """One covered gradient: where its check vector lies in the flat vectors, its shape as rows
    x columns, this rank's rows of it, and its shard blocks' row ranges."""

    index: int  # in the monitor's names
    start: int  # in the flat check vectors
    rows: int
    cols: int
    width: int  # check values per row: PROBES for a matrix, 1 for a vector (checked whole)
    local_rows: tuple[int, int]  # (first row, rows) of this rank's gradient shard
    blocks: list[tuple[int, int]]  # (first row, rows) of every rank's shard: judged apart
    weight: float = 1.0  # 1 / replication (HSDP's replicas hold equal shards)


@dataclass
class Coverage:
    """What the checksums cover in this run, for the start event and the docs' promise."""

    tensors: list[str] = field(default_factory=list)
    uncovered: list[str] = field(default_factory=list)
    reason: str = ""  # why they are off altogether, or ""

    def record(self) -> dict[str, Any]:
        if self.reason:
            return {"checksums": "off", "reason": self.reason}
        return {"checksums": len(self.tensors), "unchecked": self.uncovered[:20]}


def unsupported(layout: Layout, backend: str, compiled: bool) -> str:
    """Why a layout's gradients cannot be checked ("" when they can)."""
    if backend not in ("local", "fsdp"):
        return f"parallel.backend={backend}: its gradient partitions are not row-aligned"
    for key, size in (
        ("tensor_parallel", layout.tp),
        ("context_parallel", layout.cp),
        ("expert_parallel", layout.ep),
        ("pipeline stages", layout.pp),
        ("replica groups", layout.ft),
    ):
        if size > 1:
            return f"{key} ({size}): its layers see part of the tokens or of the features"
    if compiled:
        return "parallel.compile: the hooks would break the compiled blocks' graphs"
    return ""


def _rows_cols(shape: torch.Size) -> tuple[int, int]:
    rows = shape[0] if len(shape) else 1
    return rows, (int(torch.Size(shape[1:]).numel()) if len(shape) > 1 else 1)


def _shards(param: torch.Tensor, rows: int) -> tuple[tuple[int, int], list[tuple[int, int]]] | None:
    """(this rank's rows, every shard's rows) of a parameter sharded by rows only (FSDP2's
    Shard(0), replicated elsewhere); None for any other placement."""
    if not isinstance(param, DTensor):
        return (0, rows), [(0, rows)]
    dims = [i for i, p in enumerate(param.placements) if isinstance(p, Shard)]
    if any(not isinstance(p, Shard | Replicate) for p in param.placements) or len(dims) > 1:
        return None
    if dims and param.placements[dims[0]].dim != 0:
        return None
    offset, shape = local_block(param)
    mine = (offset[0] if offset else 0, shape[0] if shape else 1)
    if not dims:
        return mine, [(0, rows)]
    parts = param.device_mesh.size(dims[0])
    chunk = -(-rows // parts)  # torch.chunk's split, as Shard(0) makes it
    blocks = [(i * chunk, min(chunk, rows - i * chunk)) for i in range(parts) if i * chunk < rows]
    return mine, blocks


class GradChecksums:
    def __init__(
        self,
        cfg: ChecksumConfig,
        model: nn.Module,
        names: list[str],
        replication: list[int] | None,
        data_ranks: int,
        device: torch.device,
    ) -> None:
        """`names`: the monitor's gradient names (canonical); `replication`: per name, over how
        many ranks its shard repeats; `data_ranks`: over how many ranks the gradients are
        averaged (each rank's expected side counts 1/data_ranks)."""
        self.cfg, self.names, self.device = cfg, names, device
        self.data_ranks = data_ranks
        index = {name: i for i, name in enumerate(names)}
        params = {id(p): canonical_name(n) for n, p in model.named_parameters() if p.requires_grad}
        modules: list[tuple[nn.Module, list[str]]] = []
        covered: dict[str, torch.Tensor] = {}
        for module in model.modules():
            if type(module) not in (*LINEAR_TYPES, nn.Embedding, *NORM_TYPES):
                continue
            own = [getattr(module, a, None) for a in ("weight", "bias")]
            found = [params.get(id(p)) if p is not None else None for p in own]
            if found[0] is None:
                continue
            modules.append((module, [n or "" for n in found]))
            covered.update({n: p for n, p in zip(found, own, strict=True) if n})
        self.entries: dict[str, Entry] = {}
        start = 0
        for name in names:  # the monitor's order: the flat vectors follow it
            param = covered.get(name)
            if param is None:
                continue
            rows, cols = _rows_cols(param.shape)
            shards = _shards(param, rows)
            if shards is None:
                continue
            weight = 1.0 / replication[index[name]] if replication else 1.0
            width = PROBES if cols > 1 else 1
            self.entries[name] = Entry(index[name], start, rows, cols, width, *shards, weight)
            start += rows * width
        self.size = start
        self.coverage = Coverage(list(self.entries), [n for n in names if n not in self.entries])
        self.modules = [(m, ns) for m, ns in modules if ns[0] in self.entries]
        generator = torch.Generator().manual_seed(SEED)
        widths = sorted({e.cols for e in self.entries.values()})
        self.probes = {  # ±1 per column, PROBES columns per width (one for a vector)
            w: (torch.randint(0, 2, (w, PROBES if w > 1 else 1), generator=generator) * 2 - 1)
            .float()
            .to(device)
            for w in widths
        }
        self.expected = torch.zeros(self.size, device=device)
        self.ones: dict[tuple[int, torch.dtype], torch.Tensor] = {}  # the last token count's
        self.handles: list[Any] = []
        self.active = False
        self.dropped: set[str] = set()
        self.recomputed: dict[nn.Module, torch.Tensor] = {}  # a checkpointed norm's input
        self.checkpointed: set[nn.Module] = set()
        self._blocks()

    # --- hooks: the expected side, as the step runs ---------------------------------------

    def install(self) -> None:
        """Forward hooks on the covered modules (each registers a gradient hook on its output)."""
        if self.handles:
            return
        for module, names in self.modules:
            hook = self._hook_for(module, names)
            self.handles.append(module.register_forward_hook(hook))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def mark_checkpointed(self, model: nn.Module) -> None:
        """Norms inside activation-checkpointed blocks: their input is taken from the backward's
        recomputation (a reference from the first forward would keep it alive)."""
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

        for wrapper in model.modules():
            if isinstance(wrapper, CheckpointWrapper):
                self.checkpointed.update(m for m in wrapper.modules() if isinstance(m, NORM_TYPES))

    def _hook_for(self, module: nn.Module, names: list[str]) -> Callable:
        weight, bias = self.entries[names[0]], self.entries.get(names[1])
        if isinstance(module, LINEAR_TYPES):
            return self._linear_hook(weight, bias)
        if isinstance(module, nn.Embedding):
            return self._embedding_hook(weight)
        return self._norm_hook(module, weight, bias)

    def _wanted(self, output: Any) -> bool:
        return self.active and isinstance(output, torch.Tensor) and output.requires_grad

    def rows_of(self, entry: Entry, vector: torch.Tensor) -> torch.Tensor:
        """The entry's check values in `vector`, as rows x width."""
        return vector.narrow(0, entry.start, entry.rows * entry.width).view(entry.rows, -1)

    def _add(self, entry: Entry, values: torch.Tensor) -> None:
        if entry.rows:  # rows x width (or rows), FP32
            self.rows_of(entry, self.expected).add_(values.reshape(entry.rows, -1))

    def _linear_hook(self, weight: Entry, bias: Entry | None) -> Callable:
        probe = self.probes[weight.cols]

        def forward(module: nn.Module, args: tuple, output: Any) -> None:
            if not self._wanted(output) or torch._C._current_graph_task_id() != -1:
                return  # a checkpointed block's recomputation: its output gets no gradient
            x = _as_multiplied(args[0].detach()).reshape(-1, weight.cols)  # no graph
            # Unseen by selective checkpointing's op cache, and in FP32: autocast would round
            # each token's number to BF16 again.
            with _disable_current_modes(), autocast_off(x.device.type):
                s = x.float() @ probe

            def backward(dy: torch.Tensor) -> None:
                d = dy.reshape(-1, weight.rows)
                self._add(weight, _weighted_sums(s, d))
                if bias is not None:
                    self._add(bias, self.column_sums(d))

            output.register_hook(backward)

        return forward

    def column_sums(self, d: torch.Tensor) -> torch.Tensor:
        """Σ over tokens of each column: a matrix-vector product (a BF16 `sum(0)` in FP32 is
        ten times slower on CPUs)."""
        key = (d.shape[0], d.dtype)
        if key not in self.ones:
            self.ones = {key: torch.ones(d.shape[0], dtype=d.dtype, device=d.device)}
        return self.ones[key] @ d

    def _embedding_hook(self, weight: Entry) -> Callable:
        probe = self.probes[weight.cols]

        def forward(module: nn.Module, args: tuple, output: Any) -> None:
            if not self._wanted(output) or torch._C._current_graph_task_id() != -1:
                return
            ids = args[0].detach().reshape(-1)

            def backward(dy: torch.Tensor) -> None:
                per_token = dy.reshape(-1, weight.cols).float() @ probe
                if weight.rows:
                    self.rows_of(weight, self.expected).index_add_(0, ids, per_token)

            output.register_hook(backward)

        return forward

    def _norm_hook(self, module: nn.Module, weight: Entry, bias: Entry | None) -> Callable:
        checkpointed = module in self.checkpointed

        def forward(norm: nn.Module, args: tuple, output: Any) -> None:
            if not self._wanted(output):
                return
            if torch._C._current_graph_task_id() != -1:  # recomputed in backward
                if checkpointed:
                    self.recomputed[norm] = args[0].detach()
                return
            x = None if checkpointed else args[0].detach()  # the norm's backward keeps it too

            def backward(dy: torch.Tensor) -> None:
                source = x if x is not None else self.recomputed.pop(norm)
                d = dy.reshape(-1, weight.rows).float()  # FP32 sums over tokens are fast
                normalized = _normalized(norm, source.reshape(d.shape))
                self._add(weight, (normalized * d).sum(0))
                if bias is not None:
                    self._add(bias, d.sum(0))

            output.register_hook(backward)

        return forward

    # --- the step's check -------------------------------------------------------------------

    def begin(self, step: int) -> None:
        """Before the step's first forward (and before a replay's): on while `step` is within
        monitor.checksum.until_step (-1: the whole run); the expected side starts at 0."""
        until = self.cfg.until_step
        self.active = self.cfg.enabled and (until < 0 or step <= until)
        if self.active:
            self.install()
            self.expected.zero_()
        else:
            self.remove()
        self.recomputed.clear()

    def slots(self) -> list[Slot]:
        """Both sides' check vectors, summed over ranks and used on the device only."""
        return [Slot(n, self.size, "sum", host=False) for n in (OBSERVED, EXPECTED)]

    def take(
        self, named_grads: list[tuple[str, torch.Tensor]], grad_factor: float, loss_scale: float
    ) -> dict[str, torch.Tensor]:
        """This rank's contributions: its gradient shards' check vectors (the gradients still
        carry `grad_factor`) and its expected side (made from the loss scaled by `loss_scale`),
        each over the gradients' true scale."""
        observed = torch.zeros(self.size, device=self.device)
        for name, grad in named_grads:
            entry = self.entries.get(name)
            first, rows = entry.local_rows if entry is not None else (0, 0)
            if entry is None or not rows or grad.numel() != rows * entry.cols:
                continue
            values = grad.reshape(rows, entry.cols).float() @ self.probes[entry.cols]
            mine = self.rows_of(entry, observed).narrow(0, first, rows)
            mine.add_(values, alpha=entry.weight)
        observed /= grad_factor
        expected = self.expected / (loss_scale * self.data_ranks)
        return {OBSERVED: observed, EXPECTED: expected}

    def _blocks(self) -> None:
        """Each value's block (a shard's rows of one tensor) and each block's tensor, for
        `residuals`."""
        block_of, tensor_of = [], []
        for entry in self.entries.values():
            for _, rows in entry.blocks:
                block_of += [len(tensor_of)] * (rows * entry.width)
                tensor_of.append(entry.index)
        self.block_of = torch.tensor(block_of, dtype=torch.long, device=self.device)
        self.tensor_of = torch.tensor(tensor_of, dtype=torch.long, device=self.device)

    def residuals(self, pack: Pack, global_norm: torch.Tensor) -> torch.Tensor:
        """Per monitored tensor, its largest block residual (0 where unchecked): on the device,
        read with the step's other numbers."""
        observed, expected = pack[OBSERVED], pack[EXPECTED]
        blocks = len(self.tensor_of)

        def per_block(values: torch.Tensor) -> torch.Tensor:
            out = torch.zeros(blocks, device=values.device)
            return out.index_add_(0, self.block_of, values.square()).sqrt()

        diff = per_block(observed - expected)
        scale = torch.maximum(per_block(observed), per_block(expected))
        scale = torch.maximum(scale, FLOOR * global_norm.reshape(()).to(scale))
        residual = diff / scale
        out = torch.zeros(len(self.names), device=observed.device)
        return out.scatter_reduce_(0, self.tensor_of, residual, "amax")

    def mismatches(self, residuals: list[float]) -> list[list]:
        """[name, residual] of the checked tensors whose residual exceeds the tolerance."""
        covered = [e.index for name, e in self.entries.items() if name not in self.dropped]
        return mismatched(self.names, residuals, covered, self.cfg.tolerance)

    def drop(self, names: list[str]) -> None:
        """Tensors whose mismatch came back in the replay: deterministic, so rounding beyond the
        tolerance, not a fault; they are no longer judged (the healer's event names them)."""
        self.dropped.update(names)


def mismatched(
    names: list[str], residuals: list[float], covered: list[int], tolerance: float
) -> list[list]:
    """[name, residual] of the `covered` tensors (indices) whose residual exceeds `tolerance`
    (a NaN too: the non-finite check has caught that step first), largest first."""
    out = [[names[i], residuals[i]] for i in covered if not residuals[i] <= tolerance]
    return sorted(out, key=lambda x: -x[1] if x[1] == x[1] else -math.inf)


def _as_multiplied(x: torch.Tensor) -> torch.Tensor:
    """The layer's input as its matmul reads it: under autocast an FP32 input is rounded to the
    autocast dtype first, and the weight's gradient is made of that rounding."""
    dtype = autocast_dtype(x.device.type)
    return x.to(dtype) if dtype is not None and x.is_floating_point() else x


def _weighted_sums(s: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """dYᵀ S (S: tokens x probes, FP32) in FP32, as rows x probes, without converting dY: a BF16
    dY is multiplied by S split into two BF16 parts (S = high + low to 16 bits), so each sum is
    rounded once, at its end, and never per token."""
    if d.dtype == torch.float32:
        return (s.t() @ d).t()
    high = s.t().to(d.dtype)
    low = (s.t() - high.float()).to(d.dtype)
    both = torch.cat([high, low]) @ d  # (2 x probes) x rows, one pass over dY
    return both.float().view(2, s.shape[1], -1).sum(0).t()


def _normalized(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The norm's input normalized without its gain and bias, in FP32 as the norms compute it."""
    x32 = x.float()
    if isinstance(norm, RMSNorm):
        return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.eps)
    return F.layer_norm(x32, norm.normalized_shape, None, None, norm.eps)
