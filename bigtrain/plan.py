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

from dataclasses import dataclass

import torch

from bigtrain.config.schema import Config
from bigtrain.data.prepared import PreparedData
from bigtrain.model import build_model, num_params
from bigtrain.parallel.mesh import for_mesh, mesh_shape
from bigtrain.plan_comm import TPLayout, fsdp_traffic, tp_layout
from bigtrain.precision.policy import Hardware, PrecisionPolicy, dtype_name, resolve_policy
from bigtrain.utils.sizes import parse_size

COMPONENTS = ("compute copies", "gradients", "master weights", "optimizer states")


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each component, and whether it is divided over the ranks."""

    bytes_per_param: dict[str, float]
    sharded: dict[str, bool]

    def per_rank_bytes_per_param(self, world_size: int) -> dict[str, float]:
        return {
            c: b / world_size if self.sharded[c] else b for c, b in self.bytes_per_param.items()
        }


def zero_paper_layout(stage: int) -> StateBytes:
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


def bigtrain_layout(backend: str, stage: int, policy: PrecisionPolicy) -> StateBytes:
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


def vocab_size_for_plan(cfg: Config) -> int:
    if cfg.model.vocab_size:
        return cfg.model.vocab_size
    if cfg.data.source == "prepared":  # every source has the first one's tokenizer
        return PreparedData.open(cfg.data.mixture[0].path, verify=False).vocab_size
    if cfg.data.tokenizer == "bpe":
        return cfg.data.vocab_size
    from bigtrain.data.tokens import load_tokenizer

    return len(load_tokenizer(cfg.data.tokenizer))


def meta_model(cfg: Config) -> torch.nn.Module:
    """The model on the meta device: shapes only, no storage."""
    with torch.device("meta"):
        return build_model(cfg.model, vocab_size_for_plan(cfg))


def count_params(cfg: Config, model: torch.nn.Module | None = None) -> tuple[int, int]:
    """(parameters, largest transformer block's parameters), from a meta-device model."""
    from bigtrain.parallel.apply import transformer_blocks

    model = model if model is not None else meta_model(cfg)
    block = max(num_params(b) for b in transformer_blocks(model))
    return num_params(model), block


@dataclass(frozen=True)
class Shape:
    """What activation memory depends on (bigtrain's GPT; transformers models by their config)."""

    n_layers: int
    d_model: int
    d_ff: int
    kv_width: int  # width of K (= of V): n_kv_heads x head_dim
    n_heads: int
    seq_len: int
    vocab_size: int
    swiglu: bool
    rmsnorm: bool


def model_shape(cfg: Config) -> Shape:
    from bigtrain.model.gpt import default_d_ff

    m = cfg.model
    if m.kind == "hf":
        with torch.device("meta"):
            hf = build_model(m, vocab_size_for_plan(cfg)).hf.config  # type: ignore[union-attr]
        d = getattr(hf, "hidden_size", getattr(hf, "n_embd", 0))
        heads = getattr(hf, "num_attention_heads", getattr(hf, "n_head", 1))
        kv = getattr(hf, "num_key_value_heads", None) or heads
        ff = getattr(hf, "intermediate_size", None) or getattr(hf, "n_inner", None) or 4 * d
        swiglu = getattr(hf, "hidden_act", "") == "silu"
        rms = getattr(hf, "rms_norm_eps", None) is not None
        layers = getattr(hf, "num_hidden_layers", getattr(hf, "n_layer", 0))
        return Shape(layers, d, ff, kv * d // heads, heads, m.seq_len, hf.vocab_size, swiglu, rms)
    kv = (m.n_kv_heads or m.n_heads) * (m.d_model // m.n_heads)
    return Shape(
        m.n_layers,
        m.d_model,
        m.d_ff or default_d_ff(m),
        kv,
        m.n_heads,
        m.seq_len,
        vocab_size_for_plan(cfg),
        m.mlp == "swiglu",
        m.norm == "rmsnorm",
    )


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


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError


CHECKPOINTING = ("none", "selective", "block")


def parse_bytes(text: str) -> int:
    """GPU memory: '80GiB', '80 GB', '81920MiB'. A plain number is refused: nobody means bytes,
    and GB (data sheets) and GiB (nvidia-smi, in MiB) differ by 7%, enough to change the largest
    micro-batch; guessing one would plan silently wrong half the time."""
    return parse_size(text, "--gpu-memory", unit_required=True)


def reserve_bytes(gpu_memory: int) -> int:
    """Kept free for the CUDA context, NCCL buffers and allocator fragmentation: 1 GiB + 5%."""
    return 2**30 + gpu_memory // 20


def largest_micro_batch(
    gpu_memory: int, persistent: float, transient_weights: float, per_sequence: float
) -> int:
    """Sequences per micro-batch that fit next to the states and the transient weights."""
    free = gpu_memory - reserve_bytes(gpu_memory) - persistent - transient_weights
    return max(0, int(free // per_sequence))


def gathered_dtype_bytes(cfg: Config, policy: PrecisionPolicy) -> int:
    """Bytes per element of the weights FSDP2 all-gathers (its MixedPrecisionPolicy)."""
    from bigtrain.parallel.fsdp import fsdp_mixed_precision

    return fsdp_mixed_precision(policy).param_dtype.itemsize  # type: ignore[union-attr]


def transient_weight_bytes(cfg: Config, policy: PrecisionPolicy, n: int, block: int) -> float:
    """Weights and gradients that exist only around compute. FSDP2 gathers in its param dtype
    (the compute dtype, or FP32 with a precision schedule or FP32 modules): the current block
    and the prefetched next with resharding after forward, or every block from its forward to
    its backward without; plus one block's unsharded FP32 gradients before the reduce-scatter.
    ZeRO-3 gathers the current and the prefetched block in the compute dtype. Local autocast
    casts one block's weights at a time."""
    c = policy.compute_dtype.itemsize
    grads = block * policy.reduce_dtype.itemsize
    if cfg.parallel.backend == "fsdp":
        gathered = gathered_dtype_bytes(cfg, policy)
        held = 2 * block if cfg.parallel.reshard_after_forward else n
        return held * gathered + grads
    if cfg.parallel.backend == "zero" and cfg.parallel.zero_stage == 3:
        return 2 * block * c + grads
    return block * c


def activation_lines(
    cfg: Config,
    policy: PrecisionPolicy,
    n: int,
    block: int,
    degree: float,
    gpu_memory: int | None,
    tp_split: int = 1,
) -> list[str]:
    """`tp_split`: the tp degree where tensor parallelism splits every activation (bigtrain's
    GPT: sequence-parallel stream, heads, MLP units, vocabulary), else 1 (a transformers model
    under a tp_plan keeps its norms and residual stream whole: counted whole, an upper bound)."""
    shape = model_shape(cfg)
    c = policy.compute_dtype.itemsize
    residual = residual_bytes(cfg, policy)
    attention = (
        "explicit FP32-softmax attention: seq x seq probabilities kept"
        if policy.fp32_softmax
        else "SDPA attention"
    )
    lines = [
        "",
        f"activations per sequence of {shape.seq_len} tokens ({dtype_name(policy.compute_dtype)}, "
        f"{attention}; residual stream {'compute dtype' if residual == c else 'fp32'}"
        + (f"; per tp rank, split {tp_split} ways" if tp_split > 1 else "")
        + "):",
        f"  {'checkpointing':<14} {'kept':>10} {'transient':>10} {'per sequence':>13}",
    ]
    per_sequence = {}
    for mode in CHECKPOINTING:
        a = activation_bytes_per_token(shape, mode, c, residual, policy.fp32_softmax)
        kept = (a["layers"] + a["head"]) * shape.seq_len / tp_split
        transient = a["transient"] * shape.seq_len / tp_split
        per_sequence[mode] = kept + transient
        lines.append(
            f"  {mode:<14} {fmt_bytes(kept):>10} {fmt_bytes(transient):>10} "
            f"{fmt_bytes(kept + transient):>13}"
        )
    if gpu_memory is None:
        return lines
    layout = bigtrain_layout(cfg.parallel.backend, cfg.parallel.zero_stage, policy)
    persistent = sum(layout.per_rank_bytes_per_param(degree).values()) * n
    weights = transient_weight_bytes(cfg, policy, n, block) / tp_split
    fits = {
        mode: largest_micro_batch(gpu_memory, persistent, weights, per_sequence[mode])
        for mode in CHECKPOINTING
    }
    chosen = cfg.parallel.activation_checkpointing
    lines += [
        "",
        f"largest micro-batch on {fmt_bytes(gpu_memory)} per GPU (states {fmt_bytes(persistent)}, "
        f"transient weights and gradients {fmt_bytes(weights)}, reserve "
        f"{fmt_bytes(reserve_bytes(gpu_memory))}):",
    ]
    for mode in CHECKPOINTING:
        mark = "  <- parallel.activation_checkpointing" if mode == chosen else ""
        note = " (does not fit)" if fits[mode] == 0 else ""
        lines.append(f"  {mode:<14} {fits[mode]:>5}{note}{mark}")
    configured = cfg.train.micro_batch_size
    if configured > fits[chosen]:
        lines.append(
            f"  train.micro_batch_size={configured} exceeds {fits[chosen]} with "
            f"activation_checkpointing={chosen}"
        )
    return lines


def residual_bytes(cfg: Config, policy: PrecisionPolicy) -> int:
    """Bytes per value of the residual stream: the compute dtype's where the backend casts the
    weights (ZeRO, FSDP2 gathering in the compute dtype), else FP32 (autocast over FP32 weights)."""
    from bigtrain.parallel.fsdp import gathers_in_compute_dtype

    casts = cfg.parallel.backend == "zero" or (
        cfg.parallel.backend == "fsdp" and gathers_in_compute_dtype(policy)
    )
    return policy.compute_dtype.itemsize if casts else 4


def predicted_memory(cfg: Config, world_size: int, hardware: Hardware) -> dict[str, int]:
    """`bigtrain plan`'s memory per rank for `cfg` as numbers (the `oom` event reports them):
    the states (weights, gradients, optimizer), the transient weights and gradients, and the
    activations of one micro-batch under the configured checkpointing."""
    shape = mesh_shape(cfg.parallel, world_size)
    cfg = for_mesh(cfg, world_size)
    model = meta_model(cfg)
    n, block = count_params(cfg, model)
    tp = tp_layout(model, cfg.parallel.tp_plan) if shape.tp > 1 else TPLayout()
    degree = sharding_degree(cfg, world_size, n, tp)
    policy = resolve_policy(cfg.precision, hardware, n)
    split = shape.tp if tp.sequence_parallel else 1
    layout = bigtrain_layout(cfg.parallel.backend, cfg.parallel.zero_stage, policy)
    states = sum(layout.per_rank_bytes_per_param(degree).values()) * n
    weights = transient_weight_bytes(cfg, policy, n, block) / split
    c, mode = policy.compute_dtype.itemsize, cfg.parallel.activation_checkpointing
    residual = residual_bytes(cfg, policy)
    a = activation_bytes_per_token(model_shape(cfg), mode, c, residual, policy.fp32_softmax)
    per_sequence = (a["layers"] + a["head"] + a["transient"]) * cfg.model.seq_len / split
    activations = per_sequence * cfg.train.micro_batch_size
    sizes = {"states": states, "transient_weights": weights, "activations": activations}
    sizes["total"] = states + weights + activations
    return {"world_size": world_size} | {f"{k}_bytes": int(v) for k, v in sizes.items()}


def sharding_degree(cfg: Config, world_size: int, n: int, tp: TPLayout) -> float:
    """Over how many ranks the sharded states are divided, on average over the parameters: the
    shard axis of the fsdp mesh (without HSDP replicas), times tp for the layers tp splits; the
    whole data-parallel world for zero."""
    if cfg.parallel.backend != "fsdp":
        return world_size
    shape = mesh_shape(cfg.parallel, world_size)
    return n / (tp.per_rank_params(n, shape.tp) / shape.shard)


def comm_lines(
    cfg: Config, policy: PrecisionPolicy, n: int, world_size: int, tp: TPLayout
) -> list[str]:
    """fsdp: bytes each rank receives per optimizer step, by mesh axis and collective."""
    shape = mesh_shape(cfg.parallel, world_size)
    lines = ["", f"communication per rank and optimizer step, mesh {shape.describe()}:"]
    m = model_shape(cfg)
    activations = cfg.train.micro_batch_size * m.seq_len * m.d_model
    traffic = fsdp_traffic(
        cfg,
        n,
        world_size,
        gathered_dtype_bytes(cfg, policy),
        policy.reduce_dtype.itemsize,
        tp,
        activations * policy.compute_dtype.itemsize,
    )
    for t in traffic:
        lines.append(
            f"  {t.axis:<9} ({t.size:>4}) {t.collective:<18} {fmt_bytes(t.bytes_per_step):>10}"
        )
    return lines


def plan_text(
    cfg: Config, world_size: int, hardware: Hardware, gpu_memory: int | None = None
) -> str:
    shape = mesh_shape(cfg.parallel, world_size)
    cfg = for_mesh(cfg, world_size)  # the ranks of a tp group share a batch
    model = meta_model(cfg)
    n, block = count_params(cfg, model)
    tp = tp_layout(model, cfg.parallel.tp_plan) if shape.tp > 1 else TPLayout()
    degree = sharding_degree(cfg, world_size, n, tp)
    policy = resolve_policy(cfg.precision, hardware, n)
    lines = [
        f"model: {n / 1e6:.2f}M parameters (largest block {block / 1e6:.2f}M), world size {world_size}, "
        f"backend {cfg.parallel.backend}"
        + (f" stage {cfg.parallel.zero_stage}" if cfg.parallel.backend == "zero" else ""),
        f"precision policy ({hardware.name}):",
        policy.table(),
        "",
        f"memory per rank, {cfg.parallel.backend}"
        + (f" (states sharded over {degree:.4g} ranks)" if cfg.parallel.backend == "fsdp" else "")
        + ":",
    ]
    layout = bigtrain_layout(cfg.parallel.backend, cfg.parallel.zero_stage, policy)
    per_param = layout.per_rank_bytes_per_param(degree)
    for c in COMPONENTS:
        lines.append(f"  {c:<17} {per_param[c]:>7.3f} B/param  {fmt_bytes(per_param[c] * n):>10}")
    lines.append(
        f"  {'total':<17} {sum(per_param.values()):>7.3f} B/param  {fmt_bytes(sum(per_param.values()) * n):>10}"
    )
    if cfg.parallel.backend == "fsdp":
        gathered = gathered_dtype_bytes(cfg, policy)
        held = "two gathered blocks" if cfg.parallel.reshard_after_forward else "all blocks"
        lines.append(
            f"  + transient: {held} in {gathered * 8}-bit "
            f"({fmt_bytes(transient_weight_bytes(cfg, policy, n, block))} with one block of "
            "FP32 gradients)"
        )
    lines += ["", f"all backends at world size {world_size} (B/param per rank, total per rank):"]
    for name, stage in (("local", 0), ("fsdp", 0), ("zero", 1), ("zero", 2), ("zero", 3)):
        if name == "local" and world_size > 1:
            label = "local (1 rank)"
            ws = 1
        else:
            label, ws = (f"zero-{stage}" if name == "zero" else name), world_size
        b = sum(bigtrain_layout(name, stage, policy).per_rank_bytes_per_param(ws).values())
        paper = (
            sum(zero_paper_layout(stage).per_rank_bytes_per_param(ws).values())
            if name == "zero"
            else None
        )
        extra = (
            f"   (ZeRO paper: {paper:.3f} B/param, {fmt_bytes(paper * n)})"
            if paper is not None
            else ""
        )
        lines.append(f"  {label:<15} {b:>7.3f}  {fmt_bytes(b * n):>10}{extra}")
    if cfg.parallel.backend == "fsdp":
        lines += comm_lines(cfg, policy, n, world_size, tp)
    split = shape.tp if tp.sequence_parallel else 1
    lines += activation_lines(cfg, policy, n, block, degree, gpu_memory, split)
    return "\n".join(lines)
