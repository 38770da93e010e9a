"""`bigtrain plan`'s table: the precision policy, memory per rank by component for every backend,
the traffic per mesh axis (fsdp), activations and the largest micro-batch that fits."""

from __future__ import annotations

from bigtrain.config.parallel import reshards_after_forward
from bigtrain.plan.comm import fsdp_traffic
from bigtrain.plan.experts import count_experts, expert_lines, expert_traffic
from bigtrain.plan.footprint import (
    CHECKPOINTING,
    COMPONENTS,
    PlannedRun,
    activation_bytes_per_token,
    gathered_dtype_bytes,
    largest_micro_batch,
    reserve_bytes,
    residual_bytes,
    state_bytes,
    transient_weight_bytes,
    zero_paper_bytes,
)
from bigtrain.plan.stages import pipeline_lines, proposal_lines, rank_loads
from bigtrain.precision.policy import dtype_name
from bigtrain.utils.sizes import parse_size


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError


def parse_bytes(text: str) -> int:
    """GPU memory: '80GiB', '80 GB', '81920MiB'. A plain number is refused: nobody means bytes,
    and GB (data sheets) and GiB (nvidia-smi, in MiB) differ by 7%, enough to change the largest
    micro-batch; guessing one would plan silently wrong half the time."""
    return parse_size(text, "--gpu-memory", unit_required=True)


def activation_lines(run: PlannedRun, gpu_memory: int | None) -> list[str]:
    """Activations per sequence under each checkpointing mode and, with `gpu_memory`, the
    largest micro-batch that fits beside the states (per tp rank where tp splits them)."""
    shape, policy, tp_split = run.shape, run.policy, run.tp_split_ways
    c = policy.compute_dtype.itemsize
    residual = residual_bytes(run.backend, policy)
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
    return lines + _fit_lines(run, gpu_memory, per_sequence)


def _fit_lines(run: PlannedRun, gpu_memory: int, per_sequence: dict[str, float]) -> list[str]:
    cfg, n = run.cfg, run.num_params
    persistent = sum(run.states().per_rank_bytes_per_param(run.degree).values()) * n
    weights = transient_weight_bytes(cfg.parallel, run.policy, n, run.block_params)
    weights /= run.tp_split_ways
    fits = {
        mode: largest_micro_batch(gpu_memory, persistent, weights, per_sequence[mode])
        for mode in CHECKPOINTING
    }
    chosen = cfg.parallel.activation_checkpointing
    lines = [
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


def comm_lines(run: PlannedRun) -> list[str]:
    """fsdp: bytes each rank receives per optimizer step, by mesh axis and collective."""
    cfg, policy, layout = run.cfg, run.policy, run.layout
    lines = ["", f"communication per rank and optimizer step, mesh {layout.describe()}:"]
    activations = cfg.train.micro_batch_size * run.shape.seq_len * run.shape.d_model
    gathers = cfg.train.grad_accum_steps * (2 if reshards_after_forward(cfg.parallel) else 1)
    gathered, reduced = gathered_dtype_bytes(policy), policy.reduce_dtype.itemsize
    experts = count_experts(run.model, cfg.model)
    sharded, expert_axis = expert_traffic(experts, layout, gathers, gathered, reduced)
    traffic = fsdp_traffic(
        cfg.parallel,
        cfg.train.grad_accum_steps,
        layout,
        sharded or run.num_params,
        gathered,
        reduced,
        run.tp,
        activations * policy.compute_dtype.itemsize,
    )
    traffic += expert_axis
    share = {"tp": 1.0, "shard": 1.0, "replicate": 1.0, "edp": 1.0}
    if layout.pp > 1:  # a pipeline rank's part: its blocks' tp traffic, its parameters' FSDP2
        params = max(load.params for load in rank_loads(run)) / run.num_params
        share = {"tp": 1 / layout.pp, "shard": params, "replicate": params}
        lines[-1] += " (the largest pipeline rank's part)"
    for t in traffic:
        moved = t.bytes_per_step * share[t.axis]
        lines.append(f"  {t.axis:<9} ({t.size:>4}) {t.collective:<18} {fmt_bytes(moved):>10}")
    return lines


def plan_text(run: PlannedRun, gpu_memory: int | None = None, propose: bool = False) -> str:
    """The table for a planned run (footprint.py `planned`); with `gpu_memory`, what fits, and
    with `propose` too, the layout proposed for its world size (plan/stages.py)."""
    cfg, n, policy = run.cfg, run.num_params, run.policy
    world_size, hardware = run.layout.world_size, run.hardware
    backend, stage = run.backend, cfg.parallel.zero_stage
    lines = [
        f"model: {n / 1e6:.2f}M parameters (largest block {run.block_params / 1e6:.2f}M), "
        f"world size {world_size}, backend {backend}"
        + (f" stage {stage}" if backend == "zero" else ""),
        f"precision policy ({hardware.name}):",
        policy.table(),
        "",
        f"memory per rank, {backend}"
        + (f" (states sharded over {run.degree:.4g} ranks)" if backend == "fsdp" else "")
        + ":",
    ]
    per_param = run.states().per_rank_bytes_per_param(run.degree)
    held_params = n  # what one rank's states are a share of: the model, or its pipeline rank's part
    if run.layout.pp > 1:
        held_params = max(load.params for load in rank_loads(run))
        lines.append(f"  (the largest pipeline rank's {held_params / 1e9:.2f}B parameters)")
    for c in COMPONENTS:
        lines.append(
            f"  {c:<17} {per_param[c]:>7.3f} B/param  {fmt_bytes(per_param[c] * held_params):>10}"
        )
    total = sum(per_param.values())
    lines.append(f"  {'total':<17} {total:>7.3f} B/param  {fmt_bytes(total * held_params):>10}")
    if backend == "fsdp":
        gathered = gathered_dtype_bytes(policy)
        held = "two gathered blocks" if reshards_after_forward(cfg.parallel) else "all blocks"
        if run.layout.pp > 1:
            held += " of the pipeline rank"
        transient = transient_weight_bytes(cfg.parallel, policy, held_params, run.block_params)
        transient /= run.tp_split_ways
        lines.append(
            f"  + transient: {held} in {gathered * 8}-bit "
            f"({fmt_bytes(transient)} with one block of FP32 gradients"
            + (", per tp rank)" if run.tp_split_ways > 1 else ")")
        )
    lines += backend_lines(run)
    if backend == "fsdp":
        lines += comm_lines(run)
    lines += pipeline_lines(run, fmt_bytes)
    layout, train = run.layout, cfg.train
    lines += expert_lines(
        count_experts(run.model, cfg.model),
        cfg.model,
        train.micro_batch_size * run.shape.seq_len,
        train.grad_accum_steps,
        layout.ep,
        layout.shard,
        policy.compute_dtype.itemsize,
        fmt_bytes,
    )
    lines += activation_lines(run, gpu_memory)
    if propose and gpu_memory is not None:
        lines += proposal_lines(run, run.layout.world_size, gpu_memory, fmt_bytes)
    return "\n".join(lines)


def backend_lines(run: PlannedRun) -> list[str]:
    """Every backend's states per rank at this world size, with the ZeRO paper's figure."""
    world_size, n = run.layout.world_size, run.num_params
    lines = ["", f"all backends at world size {world_size} (B/param per rank, total per rank):"]
    for name, stage in (("local", 0), ("fsdp", 0), ("zero", 1), ("zero", 2), ("zero", 3)):
        if name == "local" and world_size > 1:
            label, ranks = "local (1 rank)", 1
        else:
            label, ranks = (f"zero-{stage}" if name == "zero" else name), world_size
        b = sum(state_bytes(name, stage, run.policy).per_rank_bytes_per_param(ranks).values())
        extra = ""
        if name == "zero":
            paper = sum(zero_paper_bytes(stage).per_rank_bytes_per_param(ranks).values())
            extra = f"   (ZeRO paper: {paper:.3f} B/param, {fmt_bytes(paper * n)})"
        lines.append(f"  {label:<15} {b:>7.3f}  {fmt_bytes(b * n):>10}{extra}")
    return lines
