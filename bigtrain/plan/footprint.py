"""`bigtrain plan`: the resolved precision policy and memory per rank by component, without
building the model (it is instantiated on the meta device: shapes only, no storage).

Accounting follows the ZeRO paper (Rajbhandari et al. 2020, section 3): with mixed-precision Adam
each parameter costs compute copy + gradient + FP32 master + two FP32 moments (2 + 2 + 4 + 4 + 4 =
16 bytes), and ZeRO stage 1 divides the optimizer part (master and moments) by the data-parallel
degree N, stage 2 the gradients too, stage 3 the compute copies too. bigtrain's own numbers differ
where its precision policy does: gradients are accumulated and reduced in FP32 (4 bytes), and
local/FSDP2 keep no persistent BF16 copy (the FP32 master is the module parameter; BF16 copies
exist only transiently, per matmul under autocast or per gathered block under FSDP2).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from bigtrain.config.parallel import reshards_after_forward
from bigtrain.config.schema import Config, Fp8Config, ParallelConfig
from bigtrain.parallel.layout import Layout
from bigtrain.plan.comm import TPSplit, tp_split
from bigtrain.plan.shapes import Shape, count_params, meta_model, model_shape
from bigtrain.precision.policy import Hardware, PrecisionPolicy, resolve_policy

COMPONENTS = ("compute copies", "gradients", "master weights", "optimizer states")


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each component, and whether it is divided over the ranks."""

    bytes_per_param: dict[str, float]
    sharded: dict[str, bool]

    def per_rank_bytes_per_param(self, degree: float) -> dict[str, float]:
        """Each component's bytes on one rank when the sharded ones are divided `degree` ways."""
        return {c: b / degree if self.sharded[c] else b for c, b in self.bytes_per_param.items()}


def zero_paper_bytes(stage: int) -> StateBytes:
    """The paper's mixed-precision Adam: FP16 parameters and gradients, FP32 master and moments."""
    return StateBytes(
        {"compute copies": 2, "gradients": 2, "master weights": 4, "optimizer states": 8},
        {
            "compute copies": stage >= 3,
            "gradients": stage >= 2,
            "master weights": stage >= 1,
            "optimizer states": stage >= 1,
        },
    )


def state_bytes(backend: str, stage: int, policy: PrecisionPolicy) -> StateBytes:
    """What bigtrain's backends actually keep, under `policy`."""
    master = policy.master_dtype.itemsize
    grads = policy.reduce_dtype.itemsize
    states = 2 * policy.optimizer_state_dtype.itemsize
    if backend in ("local", "fsdp"):
        sharded = backend == "fsdp"
        return StateBytes(
            {
                "compute copies": 0,
                "gradients": grads,
                "master weights": master,
                "optimizer states": states,
            },
            {c: sharded for c in COMPONENTS},
        )
    # ZeRO: the module holds compute-dtype copies; the ZeRO optimizer holds FP32 partitions.
    return StateBytes(
        {
            "compute copies": policy.compute_dtype.itemsize,
            "gradients": grads,
            "master weights": master,
            "optimizer states": states,
        },
        {
            "compute copies": stage >= 3,
            "gradients": stage >= 2,
            "master weights": True,
            "optimizer states": True,
        },
    )


@dataclass(frozen=True)
class PlannedRun:
    """What the planner derives once from a config at a world size: the run's Layout (the same
    arithmetic a run of the config does), the config with its batch for that layout, the model on
    the meta device, its size, what tensor parallelism splits, and the precision policy."""

    cfg: Config
    layout: Layout
    model: torch.nn.Module
    num_params: int
    block_params: int  # the largest transformer block's
    tp: TPSplit
    policy: PrecisionPolicy
    shape: Shape
    hardware: Hardware  # what the policy was resolved for
    held_batch: bool = False
    """True where train.global_batch_size does not divide at this size and the config's
    micro_batch_size x grad_accum_steps per data-parallel rank is held (`planned`)."""

    @property
    def backend(self) -> str:
        return self.cfg.parallel.backend

    @property
    def degree(self) -> float:
        """Over how many ranks the sharded states are divided, on average over the parameters:
        the shard axis of the fsdp mesh (without HSDP replicas), times tp for the layers tp
        splits; every data-parallel rank for zero."""
        if self.backend != "fsdp":
            return self.layout.dp_size
        n = self.num_params
        return n / (self.tp.per_rank_params(n, self.layout.tp) / self.layout.shard_ranks)

    @property
    def tp_split_ways(self) -> int:
        """The tp degree where tensor parallelism splits every activation (bigtrain's GPT:
        sequence-parallel stream, heads, MLP units, vocabulary), else 1 (a transformers model
        under a tp_plan keeps its norms and residual stream whole: counted whole, an upper
        bound)."""
        return self.layout.tp if self.tp.sequence_parallel else 1

    @property
    def activation_split(self) -> int:
        """Over how many ranks one sequence's activations are divided: the cp ranks (each holds
        its chunks of the sequence) times tp_split_ways."""
        return self.tp_split_ways * self.layout.cp

    def states(self) -> StateBytes:
        return state_bytes(self.backend, self.cfg.parallel.zero_stage, self.policy)


def planned(
    cfg: Config, world_size: int, hardware: Hardware, global_batch: bool = True
) -> PlannedRun:
    """`cfg` planned at `world_size` ranks on `hardware`, with the accumulation a run derives
    from train.global_batch_size; ConfigError (exit 2) with the keys and numbers when the layout
    does not divide, or the global batch does and `global_batch` is True. With `global_batch`
    False a batch that does not divide at this size is left for the config's per-rank batch
    (`held_batch`): the layout proposal and the goodput plan, which plan sizes the recipe's batch
    may not fit."""
    layout = Layout.of(cfg.parallel, world_size)
    t = cfg.train
    per_step = t.micro_batch_size * layout.dp_size  # tp ranks and stages share a batch
    divides = t.global_batch_size is None or (
        t.global_batch_size >= per_step and t.global_batch_size % per_step == 0
    )
    held = not (divides or global_batch)  # else Layout.batch says what does not divide
    if not held:
        cfg = dataclasses.replace(cfg, train=layout.batch(t))
    model = meta_model(cfg.model, cfg.data)
    n, block = count_params(model, layout.ep)
    tp = tp_split(model, cfg.parallel.tp_plan) if layout.tp > 1 else TPSplit()
    policy = resolve_policy(cfg.precision, hardware, n)
    if policy.fp8:
        plan_fp8(cfg.precision.fp8, cfg.parallel, model, policy)
    shape = model_shape(cfg.model, cfg.data)
    return PlannedRun(cfg, layout, model, n, block, tp, policy, shape, hardware, held)


def replanned(run: PlannedRun, cfg: Config, world_size: int) -> PlannedRun:
    """`run`'s model under another config's parallel and train keys at `world_size` (the layout
    proposal: the meta model and the policy are reused)."""
    layout = Layout.of(cfg.parallel, world_size)
    tp = tp_split(run.model, cfg.parallel.tp_plan) if layout.tp > 1 else TPSplit()
    return dataclasses.replace(run, cfg=cfg, layout=layout, tp=tp)


def activation_bytes_per_token(
    shape: Shape, mode: str, compute_bytes: int, residual_bytes: int, fp32_softmax: bool = False
) -> dict[str, float]:
    """Bytes autograd keeps per token, from what each op of a block saves for backward (SDPA
    attention keeps no seq x seq scores; the explicit FP32-softmax path keeps the probabilities in
    FP32 and in the compute dtype, heads x seq values per token each). `layers`: kept for all layers until backward; `transient`:
    one layer's activations recomputed in backward (checkpointing); `head`: final norm, lm_head
    and the FP32 log-softmax of the loss. `residual_bytes`: 4 when the residual stream is FP32
    (autocast over FP32 weights), the compute dtype's size when the weights are cast (FSDP2, ZeRO).
    """
    h, f, kv, c, r = shape.d_model, shape.d_ff, shape.kv_width, compute_bytes, residual_bytes
    up = 2 * f if shape.swiglu else f  # width of the up projection's output (SwiGLU: + gate's)
    mlp = (up + 2 * f) * c if shape.swiglu else 2 * f * c  # up out (+ silu out), down input
    # Norms compute in FP32: LayerNorm keeps its FP32 input, RMSNorm also its normalised value.
    # (Rotary positions keep nothing: only the constant tables.)
    norm = 8 * h if shape.rmsnorm else 4 * h
    # two norms; the q/k/v projections' input, q/k/v, attention output (also proj's input: the transpose back of
    # SDPA's output is a view), up input; the MLP
    full = 2 * norm + c * (h + (h + 2 * kv) + h + h) + mlp
    if fp32_softmax:
        full += shape.n_heads * shape.seq_len * (4 + c)
    matmul_outputs = c * ((h + 2 * kv) + h + h + up + h)  # q/k/v, attention, proj, up, down
    if fp32_softmax:
        matmul_outputs += shape.n_heads * shape.seq_len * 4  # the FP32 scores
    kept = {"none": full, "block": r * h, "selective": r * h + matmul_outputs}[mode]
    v = shape.vocab_size
    return {
        "layers": shape.n_layers * kept,
        # during backward: one layer recomputed; the logits in the compute dtype and in FP32
        "transient": (0 if mode == "none" else full) + (c + 4) * v,
        "head": norm + c * h + 4 * v,  # final norm, lm_head input, FP32 log-softmax
    }


CHECKPOINTING = ("none", "selective", "block")


def reserve_bytes(gpu_memory: int) -> int:
    """Kept free for the CUDA context, NCCL buffers and allocator fragmentation: 1 GiB + 5%."""
    return 2**30 + gpu_memory // 20


def largest_micro_batch(
    gpu_memory: int, persistent: float, transient_weights: float, per_sequence: float
) -> int:
    """Sequences per micro-batch that fit next to the states and the transient weights."""
    free = gpu_memory - reserve_bytes(gpu_memory) - persistent - transient_weights
    return max(0, int(free // per_sequence))


def plan_fp8(
    fp8: Fp8Config, parallel: ParallelConfig, model: torch.nn.Module, policy: PrecisionPolicy
) -> None:
    """The FP8 layers a run of `cfg` would make, as shares of the model (nothing is converted):
    the policy's FP8 all-gather and the share of the parameters in FP8 layers."""
    from bigtrain.parallel.model_setup import fp8_all_gather
    from bigtrain.precision.fp8 import select_fp8_layers

    if policy.fp8_auto and parallel.backend == "zero":  # as a run decides (model_setup.py)
        policy.fp8 = False
        policy.phases = tuple(dataclasses.replace(p, fp8=False) for p in policy.phases)
        policy.reasons["fp8"] = "auto: would pay here, but parallel.backend=zero"
        return
    fp32 = tuple(p for phase in policy.phases for p in phase.fp32_modules)
    chosen, policy.fp8_excluded = select_fp8_layers(model, fp8, policy.fp8_auto, fp32)
    policy.fp8_all_gather = parallel.backend == "fsdp" and fp8_all_gather(fp8, parallel)
    fp8 = sum(layer.weight.numel() for _, _, layer in chosen)
    policy.fp8_share = fp8 / max(1, sum(p.numel() for p in model.parameters()))


def gathered_dtype_bytes(policy: PrecisionPolicy) -> float:
    """Bytes per element of the weights FSDP2 all-gathers (its MixedPrecisionPolicy); with the
    FP8 all-gather, the FP8 layers' weights (policy.fp8_share of them) travel in one byte (their
    scales, one FP32 number per tensor, are left out)."""
    from bigtrain.parallel.backends.fsdp import fsdp_mixed_precision

    itemsize = fsdp_mixed_precision(policy).param_dtype.itemsize  # type: ignore[union-attr]
    if policy.fp8 and policy.fp8_all_gather:
        return itemsize * (1 - policy.fp8_share) + 1 * policy.fp8_share
    return itemsize


def transient_weight_bytes(
    parallel: ParallelConfig, policy: PrecisionPolicy, n: int, block: int
) -> float:
    """Weights and gradients that exist only around compute. FSDP2 gathers in its param dtype
    (the compute dtype, or FP32 with a precision schedule or FP32 modules): the current block
    and the prefetched next with resharding after forward, or every block from its forward to
    its backward without; plus one block's unsharded FP32 gradients before the reduce-scatter.
    ZeRO-3 gathers the current and the prefetched block in the compute dtype. Local autocast
    casts one block's weights at a time."""
    c = policy.compute_dtype.itemsize
    grads = block * policy.reduce_dtype.itemsize
    if parallel.backend == "fsdp":
        gathered = gathered_dtype_bytes(policy)
        held = 2 * block if reshards_after_forward(parallel) else n
        return held * gathered + grads
    if parallel.backend == "zero" and parallel.zero_stage == 3:
        return 2 * block * c + grads
    return block * c


def residual_bytes(backend: str, policy: PrecisionPolicy) -> int:
    """Bytes per value of the residual stream: the compute dtype's where the backend casts the
    weights (ZeRO, FSDP2 gathering in the compute dtype), else FP32 (autocast over FP32 weights)."""
    from bigtrain.parallel.backends.fsdp import gathers_in_compute_dtype

    casts = backend == "zero" or (backend == "fsdp" and gathers_in_compute_dtype(policy))
    return policy.compute_dtype.itemsize if casts else 4
