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
from bigtrain.model import build_model, num_params
from bigtrain.precision.policy import Hardware, PrecisionPolicy, dtype_name, resolve_policy

COMPONENTS = ("compute copies", "gradients", "master weights", "optimizer states")


@dataclass(frozen=True)
class Layout:
    """Bytes per parameter of each component, and whether it is divided over the ranks."""

    bytes_per_param: dict[str, float]
    sharded: dict[str, bool]

    def per_rank_bytes_per_param(self, world_size: int) -> dict[str, float]:
        return {
            c: b / world_size if self.sharded[c] else b for c, b in self.bytes_per_param.items()
        }


def zero_paper_layout(stage: int) -> Layout:
    """The paper's mixed-precision Adam: FP16 parameters and gradients, FP32 master and moments."""
    return Layout(
        {"compute copies": 2, "gradients": 2, "master weights": 4, "optimizer states": 8},
        {
            "compute copies": stage >= 3,
            "gradients": stage >= 2,
            "master weights": stage >= 1,
            "optimizer states": stage >= 1,
        },
    )


def bigtrain_layout(backend: str, stage: int, policy: PrecisionPolicy) -> Layout:
    """What bigtrain's backends actually keep, under `policy`."""
    master = policy.master_dtype.itemsize
    grads = policy.reduce_dtype.itemsize
    states = 2 * policy.optimizer_state_dtype.itemsize
    if backend in ("local", "fsdp"):
        sharded = backend == "fsdp"
        return Layout(
            {
                "compute copies": 0,
                "gradients": grads,
                "master weights": master,
                "optimizer states": states,
            },
            {c: sharded for c in COMPONENTS},
        )
    # ZeRO: the module holds compute-dtype copies; the ZeRO optimizer holds FP32 partitions.
    return Layout(
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
    if cfg.data.tokenizer == "bpe":
        return cfg.data.vocab_size
    from bigtrain.data.tokens import load_tokenizer

    return len(load_tokenizer(cfg.data.tokenizer))


def count_params(cfg: Config) -> tuple[int, int]:
    """(parameters, largest transformer block's parameters), from a meta-device model."""
    from bigtrain.parallel.apply import transformer_blocks

    with torch.device("meta"):
        model = build_model(cfg.model, vocab_size_for_plan(cfg))
    block = max(num_params(b) for b in transformer_blocks(model))
    return num_params(model), block


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError


def plan_text(cfg: Config, world_size: int, hardware: Hardware) -> str:
    n, block = count_params(cfg)
    policy = resolve_policy(cfg.precision, hardware, n)
    lines = [
        f"model: {n / 1e6:.2f}M parameters (largest block {block / 1e6:.2f}M), world size {world_size}, "
        f"backend {cfg.parallel.backend}"
        + (f" stage {cfg.parallel.zero_stage}" if cfg.parallel.backend == "zero" else ""),
        f"precision policy ({hardware.name}):",
        policy.table(),
        "",
        f"memory per rank, {cfg.parallel.backend}:",
    ]
    layout = bigtrain_layout(cfg.parallel.backend, cfg.parallel.zero_stage, policy)
    per_param = layout.per_rank_bytes_per_param(world_size)
    for c in COMPONENTS:
        lines.append(f"  {c:<17} {per_param[c]:>7.3f} B/param  {fmt_bytes(per_param[c] * n):>10}")
    lines.append(
        f"  {'total':<17} {sum(per_param.values()):>7.3f} B/param  {fmt_bytes(sum(per_param.values()) * n):>10}"
    )
    if cfg.parallel.backend == "fsdp":
        lines.append(
            f"  + transient: one gathered block in {dtype_name(policy.compute_dtype)} ({fmt_bytes(block * policy.compute_dtype.itemsize)})"
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
    return "\n".join(lines)
