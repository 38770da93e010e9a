"""`bigtrain plan`'s table: the precision policy, memory per rank by component for every backend,
the traffic per mesh axis (fsdp, zero), the modelled step time, activations and the largest
micro-batch that fits. Every GPU's bytes come from stages.rank_loads and the step from
step_time.step_time: the numbers `--propose` and `--goodput` use."""

from __future__ import annotations

from bigtrain.config.parallel import pp_microbatches, reshards_after_forward
from bigtrain.plan.experts import count_experts, expert_lines
from bigtrain.plan.footprint import (
    CHECKPOINTING,
    COMPONENTS,
    PlannedRun,
    activation_bytes_per_token,
    gathered_dtype_bytes,
    reserve_bytes,
    residual_bytes,
    state_bytes,
    zero_paper_bytes,
)
from bigtrain.plan.proposal import proposal_lines
from bigtrain.plan.stages import micro_batch_fit, most_states, pipeline_lines, with_checkpointing
from bigtrain.plan.step_time import assumptions, rank_traffic, step_time
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
    shape, policy, split = run.shape, run.policy, run.activation_split
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
        + (f"; per rank, split {split} ways ({_split_axes(run)})" if split > 1 else "")
        + ("; all blocks: a pipeline rank's are in the table above" if run.layout.pp > 1 else "")
        + "):",
        f"  {'checkpointing':<14} {'kept':>10} {'transient':>10} {'per sequence':>13}",
    ]
    for mode in CHECKPOINTING:
        a = activation_bytes_per_token(shape, mode, c, residual, policy.fp32_softmax)
        kept = (a["layers"] + a["head"]) * shape.seq_len / split
        transient = a["transient"] * shape.seq_len / split
        lines.append(
            f"  {mode:<14} {fmt_bytes(kept):>10} {fmt_bytes(transient):>10} "
            f"{fmt_bytes(kept + transient):>13}"
        )
    if gpu_memory is None:
        return lines
    return lines + _fit_lines(run, gpu_memory)


def _split_axes(run: PlannedRun) -> str:
    """Which axes split a sequence's activations: `tp 2 x cp 4`."""
    axes = [("tp", run.tp_split_ways), ("cp", run.layout.cp)]
    return " x ".join(f"{name} {n}" for name, n in axes if n > 1)


def _fit_lines(run: PlannedRun, gpu_memory: int) -> list[str]:
    """The largest micro-batch per checkpointing mode, from the per-rank loads (the per-stage
    table's rows): with stages, sequences per pipeline micro-batch, their number held."""
    cfg = run.cfg
    chosen = cfg.parallel.activation_checkpointing
    fits = {
        mode: micro_batch_fit(with_checkpointing(run, mode), gpu_memory) for mode in CHECKPOINTING
    }
    limit = fits[chosen][1]
    sizes = (
        f"states {fmt_bytes(limit.states_bytes)}, transient weights and gradients "
        f"{fmt_bytes(limit.transient_bytes)}, reserve {fmt_bytes(reserve_bytes(gpu_memory))}"
    )
    if run.layout.pp == 1:
        head = f"largest micro-batch on {fmt_bytes(gpu_memory)} per GPU ({sizes}):"
    else:
        m = pp_microbatches(cfg.parallel, cfg.train.micro_batch_size)
        head = (
            f"largest pipeline micro-batch (sequences each, {m} per step) on "
            f"{fmt_bytes(gpu_memory)} per GPU, set by pipeline rank {limit.pp_rank} ({sizes}):"
        )
    lines = ["", head]
    for mode in CHECKPOINTING:
        mark = "  <- parallel.activation_checkpointing" if mode == chosen else ""
        note = " (does not fit)" if fits[mode][0] == 0 else ""
        lines.append(f"  {mode:<14} {fits[mode][0]:>5}{note}{mark}")
    configured = limit.sequences
    if configured > fits[chosen][0]:
        what = (
            f"train.micro_batch_size={cfg.train.micro_batch_size}"
            if run.layout.pp == 1
            else f"{configured:g} sequences per pipeline micro-batch (train.micro_batch_size="
            f"{cfg.train.micro_batch_size} in {m})"
        )
        lines.append(f"  {what} exceeds {fits[chosen][0]} with activation_checkpointing={chosen}")
    return lines


def comm_lines(run: PlannedRun) -> list[str]:
    """fsdp and zero: bytes each rank receives per optimizer step, by mesh axis and collective."""
    lines = ["", f"communication per rank and optimizer step, mesh {run.layout.describe()}:"]
    if run.layout.pp > 1:
        lines[-1] += " (the largest pipeline rank's part)"
    for t in rank_traffic(run):
        lines.append(
            f"  {t.axis:<9} ({t.size:>4}) {t.collective:<18} {fmt_bytes(t.bytes_per_step):>10}"
        )
    return lines


def step_lines(run: PlannedRun) -> list[str]:
    """The modelled step time (step_time.step_time: the proposal's and the goodput plan's)."""
    step = step_time(run)
    where = "of the largest pipeline rank " if run.layout.pp > 1 else ""
    return ["", f"step time {where}modelled at {assumptions()}:", f"  {step.describe()}"]


def plan_text(run: PlannedRun, gpu_memory: int | None = None, propose: bool = False) -> str:
    """The table for a planned run (footprint.py `planned`); with `gpu_memory`, what fits, and
    with `propose` too, the layout proposed for its world size (plan/proposal.py)."""
    cfg, n, policy = run.cfg, run.num_params, run.policy
    world_size, hardware = run.layout.world_size, run.hardware
    backend, stage = run.backend, cfg.parallel.zero_stage
    lines = [
        f"model: {n / 1e6:.2f}M parameters (largest block {run.block_params / 1e6:.2f}M), "
        f"world size {world_size}, backend {backend}"
        + (f" stage {stage}" if backend == "zero" else ""),
        f"precision policy ({hardware.name}):",
        policy.table(),
        *_held_batch_lines(run),
        "",
        f"memory per rank, {backend}"
        + (f" (states sharded over {run.degree:.4g} ranks)" if backend == "fsdp" else "")
        + ":",
    ]
    per_param = run.states().per_rank_bytes_per_param(run.degree)
    load = most_states(run)  # the states per GPU: the pipeline rank that holds the most
    if run.layout.pp > 1:
        lines.append(f"  (the largest pipeline rank's {load.params / 1e9:.2f}B parameters)")
    for c in COMPONENTS:
        lines.append(f"  {c:<17} {per_param[c]:>7.3f} B/param  {fmt_bytes(load.states[c]):>10}")
    total = sum(per_param.values())
    lines.append(f"  {'total':<17} {total:>7.3f} B/param  {fmt_bytes(load.states_bytes):>10}")
    lines.append(
        f"  checkpoint per GPU (master weights + optimizer states) "
        f"{fmt_bytes(load.checkpoint_bytes)}"
    )
    if backend == "fsdp":
        gathered = gathered_dtype_bytes(policy)
        held = "two gathered blocks" if reshards_after_forward(cfg.parallel) else "all blocks"
        if run.layout.pp > 1:
            held += " of the pipeline rank"
        lines.append(
            f"  + transient: {held} in {gathered * 8:.3g}-bit "
            f"({fmt_bytes(load.transient_bytes)} with one block of FP32 gradients"
            + (", per tp rank)" if run.tp_split_ways > 1 else ")")
        )
    lines += backend_lines(run)
    if backend in ("fsdp", "zero"):
        lines += comm_lines(run)
    lines += pipeline_lines(run, fmt_bytes)
    layout, train = run.layout, cfg.train
    lines += expert_lines(
        count_experts(run.model),
        cfg.model,
        train.micro_batch_size * run.shape.seq_len,
        train.grad_accum_steps,
        layout.ep,
        layout.shard,
        policy.compute_dtype.itemsize,
        run.shape.d_model,
        fmt_bytes,
    )
    lines += step_lines(run)
    lines += activation_lines(run, gpu_memory)
    if propose and gpu_memory is not None:
        lines += proposal_lines(run, run.layout.world_size, gpu_memory, fmt_bytes)
    return "\n".join(lines)


def _held_batch_lines(run: PlannedRun) -> list[str]:
    if not run.held_batch:
        return []
    t = run.cfg.train
    return [
        f"train.global_batch_size ({t.global_batch_size}) does not divide over the "
        f"{run.layout.dp_size} data-parallel ranks: planned with the config's micro_batch_size "
        f"({t.micro_batch_size}) x grad_accum_steps ({t.grad_accum_steps}) per rank"
    ]


def backend_lines(run: PlannedRun) -> list[str]:
    """Every backend's states per rank at this world size, with the ZeRO paper's figure: each
    over all the ranks (data parallelism alone; the memory table above has this layout's)."""
    layout, n = run.layout, run.num_params
    world_size = layout.world_size
    flat = layout.world_size == layout.shard
    alone = "" if flat else ", each over all ranks without this layout's tp, stages and replicas"
    lines = [
        "",
        f"all backends at world size {world_size} (B/param per rank, total per rank{alone}):",
    ]
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
