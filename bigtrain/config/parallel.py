"""The `parallel.*` section: the backend and the sizes of the layout's dimensions, and their
checks against each other and the model (called by config/load.py's `validate`). Whether the sizes
divide the world is checked at start, where the world is known (parallel/layout.py)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from bigtrain.config.model import ModelConfig, default_d_ff
from bigtrain.errors import ConfigError


@dataclass
class ParallelConfig:
    backend: str = "local"
    """`local`: one process, one device. `fsdp`: PyTorch FSDP2 (fully_shard per block and the root).
    `zero`: DeepSpeed ZeRO (`zero_stage`). The world size comes from the launcher."""
    zero_stage: int = 2
    """ZeRO stage for backend=zero: 1 shards optimizer states, 2 also gradients, 3 also weights."""
    activation_checkpointing: str = "none"
    """`none`; `block`: recompute each transformer block's activations in backward; `selective`:
    recompute only the cheap ops (norms, activations, adds), keep matmul and attention outputs."""
    compile: bool = False
    """torch.compile each transformer block (in place; parameter names unchanged)."""
    meta_init: bool | None = None
    """Build the model on the meta device and materialise only this rank's shards (fsdp, gpt):
    no process ever holds the whole model. None: on for fsdp from 1B parameters. The initial
    weights are those of a whole build (drawn per parameter: model/init.py)."""
    reshard_after_forward: bool | None = None
    """FSDP2: free the gathered parameters after forward (ZeRO-3-like memory) or keep them until
    backward (ZeRO-2-like speed). null: free them, except with pipeline stages, whose every
    micro-batch would gather them again (a stage's weights stay gathered through its step)."""
    replicate: int = 1
    """fsdp: replicas of the sharded model (HSDP). The ranks form a `replicate x shard` mesh;
    parameters are sharded over the shard dim (contiguous ranks, one node's) and replicated over
    the replicate dim, whose all-reduce of the gradients is the only traffic between replicas.
    world size / replicate is the shard degree; it must divide. 1: plain FSDP. At start."""
    tensor_parallel: int = 1
    """fsdp: tensor-parallel degree, the innermost mesh axis `tp` (ranks of one node): each
    matched linear layer is split over `tensor_parallel` ranks, which read the same batch.
    world size / (replicate x tensor_parallel) is the shard degree; it must divide. bigtrain's
    GPT is split by its own plan; a transformers model by `tp_plan` or, when that is empty, by
    the plan its family declares (docs/models.md). At start."""
    tp_plan: dict[str, str] = field(default_factory=dict)
    """model.kind=hf with tensor_parallel > 1, in place of the plan the family declares (empty:
    the declared one): module name patterns (fnmatch, matched against the names inside each
    transformer block, e.g. `self_attn.q_proj`) -> `colwise` (output features split: q, k, v,
    MLP gate/up) or `rowwise` (input features split, output summed: attention and MLP output
    projections), for nn.Linear and transformers Conv1D layers alike; transformers' other style
    names (`colwise_gather_output`, `rowwise_split_input`, `replicated_with_grad_allreduce`,
    `mla_kv_a_proj`; docs/models.md); `colwise_qkv` for GPT-2's fused q/k/v Conv1D
    (`attn.c_attn`: each rank computes its heads of q, k and v; its weights stay whole on every
    tp rank, see parallel/tensor/conv1d.py). A colwise layer's output must feed the next rowwise
    one. At start."""
    pipeline_parallel: int = 1
    """Pipeline stages (docs/parallelism.md): the transformer blocks split into this many
    consecutive parts, each on its own ranks, micro-batches flowing through them
    (torch.distributed.pipelining). The outermost dimension: world size / (pipeline_parallel x
    replicate x tensor_parallel) is the shard degree. local (one rank per stage, world size =
    stages) or fsdp; bigtrain's GPT, or a transformers Llama-family or GPT-2 model. At start."""
    pp_schedule: str = "1f1b"
    """`gpipe` (all forwards, then all backwards: the most activation memory), `1f1b` (one
    forward, one backward: at most `stages` micro-batches in flight), `interleaved_1f1b`
    (pp_stages_per_rank model chunks per rank: a bubble smaller by that factor, more
    point-to-point traffic), `zbv` (zero-bubble V: two chunks per rank, the first and the last
    stage on rank 0, backward split into input and weight gradients)."""
    pp_stages_per_rank: int | None = None
    """Model chunks (virtual stages) per pipeline rank: null is 1 for gpipe and 1f1b, 2 for
    interleaved_1f1b and zbv (which needs exactly 2)."""
    pp_microbatches: int | None = None
    """Pipeline micro-batches per train.micro_batch_size batch (it must divide it); null: one
    sequence each (train.micro_batch_size of them), the smallest bubble. 1f1b, interleaved_1f1b
    and zbv need at least parallel.pipeline_parallel of them."""
    pp_split: list[int] = field(default_factory=list)
    """The first block of each stage after the first (pp x pp_stages_per_rank - 1 increasing
    block indices), e.g. [5] for two stages of a 10-block model split 5/5; empty: balanced
    by each block's parameter and FLOP share, the embedding counted with the first stage and
    the final norm and output layer with the last (parallel/pipeline/split.py)."""
    expert_parallel: int = 1
    """fsdp with an MoE model (model.moe, or a transformers MoE family by its declared ep plan:
    docs/models.md): the experts of each MoE block split over this many consecutive shard
    ranks, tokens sent to their experts' rank and back with all-to-all (docs/moe.md). Must
    divide the experts and the shard degree; the experts are then FSDP2-sharded over the
    remaining shard / expert_parallel ranks, everything else over all of them. At start."""
    context_parallel: int = 1
    """fsdp: context-parallel degree, the mesh axis `cp` between shard and tp: each sequence is
    split over this many ranks of one model copy, which share its loss and attend across each
    other's chunks (docs/context-parallel.md). world size / (pipeline_parallel x replicate x
    context_parallel x tensor_parallel) is the shard degree; FSDP2 shards over shard x cp. For
    sequences whose activations do not fit one GPU. At start."""
    cp_style: str = "ring"
    """How attention crosses the cp ranks. `ring`: keys and values passed round the cp ranks,
    partial outputs merged by their log-sum-exp; the sequence cut in 2 x context_parallel chunks,
    rank i holding chunks i and 2 x context_parallel - 1 - i (equal work under causal masking);
    any degree dividing the chunks. `all_to_all` (DeepSpeed-Ulysses): two all-to-alls turn the
    sequence split into a head split and back; the degree must divide the query heads (per tp
    rank); key/value heads fewer than the degree are repeated to it."""
    timeout_s: float = 600.0
    """Timeout of every collective: a lost rank stops the others after this long instead of never."""


def check_parallel(p: ParallelConfig, m: ModelConfig) -> None:
    """What the parallel keys' types alone do not check, against the backend and the model."""
    if p.zero_stage not in (1, 2, 3):
        raise ConfigError(f"key 'parallel.zero_stage' got {p.zero_stage}, expected 1, 2 or 3")
    if p.replicate < 1:
        raise ConfigError(
            f"key 'parallel.replicate' got {p.replicate}, expected a positive integer"
        )
    if p.replicate > 1 and p.backend != "fsdp":
        raise ConfigError(
            f"key 'parallel.replicate' ({p.replicate}) needs parallel.backend=fsdp "
            f"(HSDP), got parallel.backend={p.backend}"
        )
    _check_tensor_parallel(p, m)
    check_pipeline(p, m)
    check_experts(p, m)
    check_context(p, m)
    if p.timeout_s <= 0:
        raise ConfigError(
            f"key 'parallel.timeout_s' got {p.timeout_s}, expected a positive number of seconds"
        )
    if p.activation_checkpointing == "selective" and m.dropout > 0:
        raise ConfigError(
            "parallel.activation_checkpointing=selective with model.dropout > 0: the saved "
            "attention kernels would not advance the RNG in recompute, so dropout masks would "
            "differ from the forward's; use block checkpointing or dropout 0"
        )


CP_STYLES = ("ring", "all_to_all")
CP_HF_TYPES = ("llama", "mistral", "qwen2", "qwen3")
"""transformers model types split by sequence (parallel/context/hf.py's HF_TYPES)."""


def check_context(p: ParallelConfig, m: ModelConfig) -> None:
    """Context parallelism against the backend, the model and the other dimensions."""
    cp = p.context_parallel
    if p.cp_style not in CP_STYLES:
        raise ConfigError(
            f"key 'parallel.cp_style' got {p.cp_style!r}, expected one of {list(CP_STYLES)}"
        )
    if cp < 1:
        raise ConfigError(f"key 'parallel.context_parallel' got {cp}, expected a positive integer")
    if cp == 1:
        return
    if p.backend == "zero":
        raise ConfigError(
            f"key 'parallel.context_parallel' ({cp}) needs parallel.backend=fsdp: DeepSpeed's "
            "own sequence parallelism (Ulysses) runs inside its engine's model-parallel unit and "
            "its own attention wrapper, which bigtrain's ZeRO backend does not build; use fsdp, "
            "which shards the model over shard x cp ranks like ZeRO-3 (or ZeRO-2 with "
            "parallel.reshard_after_forward=false)"
        )
    if p.backend != "fsdp":
        raise ConfigError(
            f"key 'parallel.context_parallel' ({cp}) needs parallel.backend=fsdp (the cp ranks "
            f"share one model copy), got parallel.backend={p.backend}"
        )
    model_type = (m.hf_config or {}).get("model_type") if m.kind == "hf" else None
    if model_type is not None and model_type not in CP_HF_TYPES:
        raise ConfigError(
            f"key 'parallel.context_parallel' ({cp}): model.kind=hf with model_type "
            f"{model_type!r} is not split by sequence (supported: {', '.join(CP_HF_TYPES)}, "
            "and bigtrain's GPT)"
        )
    if m.kind == "hf" and p.pipeline_parallel > 1:
        raise ConfigError(
            f"key 'parallel.context_parallel' ({cp}) with parallel.pipeline_parallel="
            f"{p.pipeline_parallel}: a transformers model's pipeline stages are not split by "
            "sequence yet (bigtrain's GPT's are)"
        )
    pieces = 2 * cp if p.cp_style == "ring" else cp
    if m.seq_len % pieces:
        raise ConfigError(
            f"key 'model.seq_len' ({m.seq_len}) must be a multiple of {pieces}: "
            f"parallel.cp_style={p.cp_style} cuts each sequence into {pieces} equal chunks "
            f"({'2 x ' if p.cp_style == 'ring' else ''}parallel.context_parallel={cp})"
        )
    heads = m.n_heads // p.tensor_parallel
    if p.cp_style == "all_to_all" and heads % cp:
        raise ConfigError(
            f"key 'parallel.context_parallel' ({cp}) must divide the query heads of each rank "
            f"({heads} = model.n_heads {m.n_heads} / parallel.tensor_parallel "
            f"{p.tensor_parallel}) with parallel.cp_style=all_to_all, which splits them over the "
            "cp ranks; use a degree that divides them, or cp_style=ring"
        )
    if m.dropout > 0:
        raise ConfigError(
            f"key 'model.dropout' ({m.dropout}) must be 0 with parallel.context_parallel={cp}: "
            "the attention kernels across cp ranks run without dropout"
        )
    if (m.seq_len // cp) % p.tensor_parallel:
        raise ConfigError(
            f"key 'parallel.tensor_parallel' ({p.tensor_parallel}) must divide the tokens each cp "
            f"rank holds (model.seq_len {m.seq_len} / parallel.context_parallel {cp}): "
            "sequence parallelism splits them over the tp ranks"
        )


def check_experts(p: ParallelConfig, m: ModelConfig) -> None:
    """Expert parallelism against the backend and the model; MoE blocks against tensor
    parallelism (whose plan has no expert layers)."""
    ep, experts = p.expert_parallel, m.moe.experts if m.kind == "gpt" else 0
    if experts and p.tensor_parallel > 1:
        raise ConfigError(
            f"key 'parallel.tensor_parallel' ({p.tensor_parallel}): MoE blocks (model.moe."
            "experts > 0) are not split by tensor parallelism; split their experts with "
            "parallel.expert_parallel instead"
        )
    if ep < 1:
        raise ConfigError(f"key 'parallel.expert_parallel' got {ep}, expected a positive integer")
    if ep == 1:
        return
    if m.kind == "hf":  # its experts are counted where it is built (parallel/experts.py)
        if p.tensor_parallel > 1:
            raise ConfigError(
                f"key 'parallel.expert_parallel' ({ep}) with parallel.tensor_parallel "
                f"({p.tensor_parallel}): a transformers model's experts are split by one of the "
                "two, not both; use one of them"
            )
    elif not experts:
        raise ConfigError(
            f"key 'parallel.expert_parallel' ({ep}) needs an MoE model (model.moe.experts > 0) "
            "or a transformers MoE family (model.kind=hf): this model has no experts to "
            "split; use 1"
        )
    if p.backend != "fsdp":
        raise ConfigError(
            f"key 'parallel.expert_parallel' ({ep}) needs parallel.backend=fsdp, got "
            f"parallel.backend={p.backend}"
        )
    if experts and experts % ep:
        raise ConfigError(
            f"key 'parallel.expert_parallel' ({ep}) must divide model.moe.experts ({experts}): "
            "each rank of an expert-parallel group holds as many experts"
        )


def _check_tensor_parallel(p: ParallelConfig, m: ModelConfig) -> None:
    if p.tensor_parallel < 1:
        raise ConfigError(
            f"key 'parallel.tensor_parallel' got {p.tensor_parallel}, expected a positive integer"
        )
    bad = {k: v for k, v in p.tp_plan.items() if v not in TP_STYLES}
    if bad:
        raise ConfigError(
            f"key 'parallel.tp_plan' got {bad}, expected one of {', '.join(TP_STYLES)}"
        )
    if p.tensor_parallel == 1:
        return
    if p.backend != "fsdp":
        raise ConfigError(
            f"key 'parallel.tensor_parallel' ({p.tensor_parallel}) needs parallel.backend=fsdp, "
            f"got parallel.backend={p.backend}"
        )
    if m.kind == "gpt":
        if p.tp_plan:
            raise ConfigError(
                f"key 'parallel.tp_plan' ({p.tp_plan}) is for model.kind=hf: bigtrain's GPT is "
                "split by its own plan (q, k, v, gate, up colwise; proj, down rowwise)"
            )
        check_gpt_tensor_parallel(m, p.tensor_parallel)
        return


def check_gpt_tensor_parallel(m: ModelConfig, tp: int) -> None:
    """What the built-in GPT's plan splits divides by the tp degree: whole heads (query and
    key/value) per rank, the MLP's hidden units, the sequence (sequence parallelism) and, once
    known, the vocabulary (the embedding and lm_head rows)."""
    if tp == 1:
        return
    n_kv = m.n_kv_heads or m.n_heads
    widths = {
        "model.n_heads": m.n_heads,
        "model.n_kv_heads": n_kv,
        "model.d_ff": m.d_ff or default_d_ff(m),
        "model.seq_len": m.seq_len,
    }
    if m.vocab_size is not None:
        widths["vocab size"] = m.vocab_size
    bad = [f"{key} = {value}" for key, value in widths.items() if value % tp]
    if bad:
        hint = ""
        if "vocab size" in widths and widths["vocab size"] % tp:
            padded = -(-widths["vocab size"] // (64 * tp)) * 64 * tp
            hint = f" (pad the table: model.vocab_size={padded}, unused rows are never targets)"
        raise ConfigError(
            f"key 'parallel.tensor_parallel' ({tp}) must divide {', '.join(bad)}: each tp rank "
            f"holds whole heads, an equal part of the MLP and vocabulary, and of the sequence{hint}"
        )


TP_STYLES = {
    "colwise": "output features split: each tp rank computes its heads or hidden units",
    "rowwise": "input features split, outputs summed over the tp ranks",
    "colwise_gather_output": "output features split, then gathered whole on every tp rank (a "
    "norm over all heads follows, or a fused projection is split after it)",
    "rowwise_split_input": "a whole input split by features on each rank, outputs summed",
    "replicated_with_grad_allreduce": "a per-head norm between the two: whole weights, its "
    "gradients summed over the tp ranks (each sees its own heads)",
    "mla_kv_a_proj": "MLA's shared key/value down-projection: whole, the gradient of its rotary "
    "part (which bypasses the split up-projection) summed over the tp ranks",
    "colwise_qkv": "GPT-2's fused q/k/v Conv1D: each rank computes its heads of q, k and v",
}
"""The tensor-parallel styles bigtrain runs, by the name plans use: transformers' names (a
family's declared plan, model/hf_plans.py) and bigtrain's colwise_qkv (GPT-2); parallel.tp_plan
takes the same names."""

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zbv")


def pp_stages_per_rank(p: ParallelConfig) -> int:
    """Model chunks per pipeline rank: the key, or the schedule's own default."""
    if p.pp_stages_per_rank is not None:
        return p.pp_stages_per_rank
    return 2 if p.pp_schedule in ("interleaved_1f1b", "zbv") else 1


def pp_microbatches(p: ParallelConfig, micro_batch_size: int) -> int:
    """Pipeline micro-batches per train.micro_batch_size batch: the key, or one sequence each."""
    return p.pp_microbatches if p.pp_microbatches is not None else micro_batch_size


def check_pipeline(p: ParallelConfig, m: ModelConfig) -> None:
    """Pipeline keys against the backend, the schedule and the model (the micro-batch count
    against the batch: check_pipeline_batch)."""
    if p.pp_schedule not in PP_SCHEDULES:
        raise ConfigError(
            f"key 'parallel.pp_schedule' got {p.pp_schedule!r}, expected one of {list(PP_SCHEDULES)}"
        )
    if p.pipeline_parallel < 1:
        raise ConfigError(
            f"key 'parallel.pipeline_parallel' got {p.pipeline_parallel}, expected a positive "
            "integer"
        )
    chunks = pp_stages_per_rank(p)
    if chunks < 1:
        raise ConfigError(
            f"key 'parallel.pp_stages_per_rank' got {chunks}, expected a positive integer"
        )
    if p.pipeline_parallel == 1:
        if p.pp_split:
            raise ConfigError(
                f"key 'parallel.pp_split' got {p.pp_split}, but parallel.pipeline_parallel is 1: "
                "one stage has no split; set parallel.pipeline_parallel, or leave pp_split empty"
            )
        return
    if p.backend == "zero":
        raise ConfigError(
            f"key 'parallel.pipeline_parallel' ({p.pipeline_parallel}) needs parallel.backend="
            "local or fsdp: DeepSpeed's pipeline engine is a design of its own (its model a "
            "PipelineModule of layer specs, its own schedule and checkpoint layout), which "
            "bigtrain's GPT, monitor and universal checkpoints do not go through; use fsdp, "
            "which shards each stage like ZeRO-3 (or ZeRO-2 with "
            "parallel.reshard_after_forward=false)"
        )
    if p.pp_schedule in ("gpipe", "1f1b") and chunks != 1:
        raise ConfigError(
            f"key 'parallel.pp_stages_per_rank' ({chunks}) must be 1 for parallel.pp_schedule="
            f"{p.pp_schedule} (one stage per rank); use interleaved_1f1b for more"
        )
    if p.pp_schedule == "zbv" and chunks != 2:
        raise ConfigError(
            f"key 'parallel.pp_stages_per_rank' ({chunks}) must be 2 for parallel.pp_schedule=zbv "
            "(the V shape: each rank holds one stage on the way down and one on the way back)"
        )
    stages = p.pipeline_parallel * chunks
    if stages > m.n_layers:
        raise ConfigError(
            f"key 'parallel.pipeline_parallel' ({p.pipeline_parallel}) x pp_stages_per_rank "
            f"({chunks}) = {stages} stages, more than model.n_layers ({m.n_layers}): every stage "
            "needs at least one block"
        )
    if p.pp_split:
        bounds = [0, *p.pp_split, m.n_layers]
        if len(p.pp_split) != stages - 1 or any(a >= b for a, b in itertools.pairwise(bounds)):
            raise ConfigError(
                f"key 'parallel.pp_split' got {p.pp_split}, expected {stages - 1} increasing "
                f"block indices between 1 and {m.n_layers - 1} (the first block of stages 1 to "
                f"{stages - 1})"
            )


def check_pipeline_batch(p: ParallelConfig, micro_batch_size: int) -> None:
    """The pipeline's micro-batches against train.micro_batch_size and the schedule."""
    if p.pipeline_parallel == 1:
        return
    n = pp_microbatches(p, micro_batch_size)
    if n < 1 or micro_batch_size % n:
        raise ConfigError(
            f"key 'parallel.pp_microbatches' ({n}) must divide train.micro_batch_size "
            f"({micro_batch_size}): each pipeline micro-batch holds an equal part of it"
        )
    if p.pp_schedule != "gpipe" and n < p.pipeline_parallel:
        raise ConfigError(
            f"key 'parallel.pp_microbatches' ({n}) is below parallel.pipeline_parallel "
            f"({p.pipeline_parallel}): parallel.pp_schedule={p.pp_schedule} keeps a micro-batch "
            "in flight on every pipeline rank; raise it (and train.micro_batch_size), or use gpipe"
        )
    if p.pp_schedule == "interleaved_1f1b":
        rounds = max(1, n // p.pipeline_parallel)
        if n % rounds:
            raise ConfigError(
                f"key 'parallel.pp_microbatches' ({n}) must be a multiple of {rounds} for "
                "interleaved_1f1b (torch's schedule runs rounds of pipeline_parallel "
                "micro-batches): use a multiple of parallel.pipeline_parallel"
            )


def reshards_after_forward(p: ParallelConfig) -> bool:
    """parallel.reshard_after_forward, or its default (see the key)."""
    if p.reshard_after_forward is not None:
        return p.reshard_after_forward
    return p.pipeline_parallel == 1
