"""The modelled step time of a planned run: the one the memory plan prints, the layout proposal
ranks layouts by and the goodput plan simulates (`step_time`), and the traffic per rank it is
made of (`rank_traffic`, the plan's communication section).

One optimizer step on a GPU cluster (H100-class, as in docs/parallelism.md):
- compute: the model's training FLOPs per token (model_flops_per_token: active parameters of an
  MoE model, attention included) times the tokens of one data-parallel rank (micro-batch x
  accumulation x sequence), over the tp x cp x pp GPUs that share them, at 989 TFLOP/s (BF16 dense)
  x 40% (Llama 3 405B ran at 38-43% MFU), stretched by the pipeline's bubble; with FP8 linears
  the FP8 layers' share of it runs faster by FP8_STEP_SPEEDUP;
- tp: the tensor-parallel collectives of the rank's blocks over NVLink (450 GB/s);
- dp: the data-parallel collectives of the rank's parameters (FSDP2's all-gathers and
  reduce-scatters, HSDP's all-reduce, the experts' over their own ranks, or ZeRO's) over
  InfiniBand (50 GB/s per GPU);
- p2p: the hidden states and their gradients between pipeline stages, over InfiniBand;
- ep: the experts' all-to-alls (dispatch and combine, forward and backward), over NVLink when the
  tp x ep ranks of an expert group fit in a node of 8 GPUs, else over InfiniBand;
- cp: context parallelism's ring sends or all-to-alls of each attention layer (comm.cp_traffic),
  over NVLink when the tp x cp ranks of a model copy fit in a node, else over InfiniBand.
The parts are added: no overlap of communication with compute, an upper bound that penalises
collectives over many ranks as their latency does. With pipeline stages every part is the
largest pipeline rank's (the one holding the most parameters).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from bigtrain.config.parallel import reshards_after_forward
from bigtrain.model import model_flops_per_token
from bigtrain.parallel.context.attention import kv_repeats
from bigtrain.plan.comm import AxisTraffic, cp_traffic, fsdp_traffic, zero_traffic
from bigtrain.plan.experts import all_to_all_bytes, count_experts, expert_traffic
from bigtrain.plan.footprint import PlannedRun, gathered_dtype_bytes
from bigtrain.plan.stages import most_states, p2p_bytes, step_bubble

PEAK_FLOPS = 989e12
EFFICIENCY = 0.4
FP8_STEP_SPEEDUP = {"tensorwise": 1.25, "rowwise": 1.10, "rowwise_with_gw_hp": 1.10}
"""Whole-step speedup of FP8 linears over BF16 by recipe, as torchao publishes it for Llama 3 8B
on 8 H100s (tensorwise with FP8 all-gather +25%, rowwise +10%); larger models gain more (405B on
512 GPUs: 1.5x), so this is conservative there. It applies to the FP8 layers' share of the
compute (policy.fp8_share of the parameters)."""
NVLINK_BYTES_S = 450e9
NETWORK_BYTES_S = 50e9
GPUS_PER_NODE = 8


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step by part (module docstring)."""

    parts: dict[str, float]
    """compute (with the bubble), tp, dp, p2p, ep for an expert-parallel model, cp with context
    parallelism."""

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    def parts_text(self) -> str:
        """'compute+bubble 6.99, tp 0.53, dp 0.76, p2p 0.09'."""
        names = {"compute": "compute+bubble"}
        return ", ".join(f"{names.get(k, k)} {v:.2f}" for k, v in self.parts.items())

    def describe(self) -> str:
        """'8.37 s (compute+bubble 6.99, tp 0.53, dp 0.76, p2p 0.09)'."""
        return f"{self.total:.2f} s ({self.parts_text()})"


def assumptions() -> str:
    """The model's constants, as the plan prints them."""
    return (
        f"{PEAK_FLOPS / 1e12:.0f} TFLOP/s x {EFFICIENCY:.0%} stretched by the bubble, tp over "
        f"{NVLINK_BYTES_S / 1e9:.0f} GB/s, data parallel and stages over "
        f"{NETWORK_BYTES_S / 1e9:.0f} GB/s per GPU, no overlap (an upper bound)"
    )


def rank_traffic(run: PlannedRun) -> list[AxisTraffic]:
    """What one rank moves per optimizer step, by mesh axis and collective: FSDP2's (with the
    experts' own axis under expert parallelism) or ZeRO's; with pipeline stages the largest
    pipeline rank's part (its blocks' tp traffic, its parameters' data-parallel traffic)."""
    cfg, policy, layout = run.cfg, run.policy, run.layout
    train = cfg.train
    accum = train.grad_accum_steps
    if run.backend == "fsdp":
        # one micro-batch's residual stream on this rank (its chunks under cp)
        activations = train.micro_batch_size * run.shape.seq_len * run.shape.d_model / layout.cp
        gathers = accum * (2 if reshards_after_forward(cfg.parallel) else 1)
        gathered, reduced = gathered_dtype_bytes(policy), policy.reduce_dtype.itemsize
        experts = count_experts(run.model)
        sharded, expert_axis = expert_traffic(experts, layout, gathers, gathered, reduced)
        traffic = fsdp_traffic(
            cfg.parallel,
            accum,
            layout,
            sharded or run.num_params,
            gathered,
            reduced,
            run.tp,
            activations * policy.compute_dtype.itemsize,
        )
        traffic += expert_axis
        if layout.cp > 1:
            traffic.append(context_traffic(run))
    elif run.backend == "zero":
        traffic = zero_traffic(
            cfg.parallel.zero_stage,
            accum,
            layout.shard,
            run.num_params,
            policy.compute_dtype.itemsize,
            policy.reduce_dtype.itemsize,
        )
    else:  # local: one process (per stage)
        traffic = []
    if layout.pp == 1:
        return traffic
    params, blocks = _stage_share(run)
    return [
        dataclasses.replace(
            t, bytes_per_step=t.bytes_per_step * (blocks if t.axis == "tp" else params)
        )
        for t in traffic
    ]


def context_traffic(run: PlannedRun) -> AxisTraffic:
    """The cp axis of `run` per step (comm.cp_traffic), on its tp rank's heads."""
    cfg, layout, shape = run.cfg, run.layout, run.shape
    accum = cfg.train.grad_accum_steps
    recompute = cfg.parallel.activation_checkpointing != "none"
    head_dim = shape.d_model // shape.n_heads
    kv_heads = shape.kv_width // head_dim // run.tp_split_ways or 1
    if layout.cp_style == "all_to_all":
        kv_heads *= kv_repeats(kv_heads, layout.cp)
    return cp_traffic(
        layout.cp_style,
        layout.cp,
        shape.n_layers,
        (accum * (2 if recompute else 1), accum),
        cfg.train.micro_batch_size * shape.seq_len / layout.cp,
        (shape.d_model // run.tp_split_ways, kv_heads * head_dim),
        run.policy.compute_dtype.itemsize,
    )


def _stage_share(run: PlannedRun) -> tuple[float, float]:
    """The largest pipeline rank's share of the parameters and of the blocks."""
    load = most_states(run)
    layers = sum(end - start for start, end in load.blocks)
    return load.params / run.num_params, layers / run.shape.n_layers


def step_time(run: PlannedRun) -> StepTime:
    """The modelled seconds of one optimizer step of `run` (module docstring)."""
    cfg, layout = run.cfg, run.layout
    train = cfg.train
    tokens = train.micro_batch_size * train.grad_accum_steps * cfg.model.seq_len
    flops = model_flops_per_token(run.model, cfg.model) * tokens / layout.model_size
    traffic = rank_traffic(run)
    compute = flops / (PEAK_FLOPS * EFFICIENCY) / (1 - step_bubble(run))
    policy = run.policy
    if policy.fp8:
        share = policy.fp8_share
        compute *= (1 - share) + share / FP8_STEP_SPEEDUP[policy.fp8_recipe]
    parts = {
        "compute": compute,
        "tp": sum(t.bytes_per_step for t in traffic if t.axis == "tp") / NVLINK_BYTES_S,
        "dp": sum(t.bytes_per_step for t in traffic if t.axis not in ("tp", "cp"))
        / NETWORK_BYTES_S,
        "p2p": p2p_bytes(run) / NETWORK_BYTES_S,
    }
    if layout.cp > 1:  # inside a node when its tp x cp ranks fit one
        moved = sum(t.bytes_per_step for t in traffic if t.axis == "cp")
        node = layout.tp * layout.cp <= GPUS_PER_NODE
        parts["cp"] = moved / (NVLINK_BYTES_S if node else NETWORK_BYTES_S)
    if layout.ep > 1:
        moved = all_to_all_bytes(
            count_experts(run.model),
            train.micro_batch_size * run.shape.seq_len,
            train.grad_accum_steps,
            layout.ep,
            run.policy.compute_dtype.itemsize,
            run.shape.d_model,
        )
        node = layout.tp * layout.ep <= GPUS_PER_NODE
        share = _stage_share(run)[1] if layout.pp > 1 else 1.0
        parts["ep"] = moved * share / (NVLINK_BYTES_S if node else NETWORK_BYTES_S)
    return StepTime(parts)
