"""Checks of the mesh keys (parallel.replicate, tensor_parallel, tp_plan) against the backend
and the model; the world size is checked at start (parallel/mesh.py)."""

from __future__ import annotations

from bigtrain.config.schema import Config
from bigtrain.errors import ConfigError


def check_mesh(config: Config) -> None:
    p = config.parallel
    if p.replicate < 1:
        raise ConfigError(
            f"key 'parallel.replicate' got {p.replicate}, expected a positive integer"
        )
    if p.replicate > 1 and p.backend != "fsdp":
        raise ConfigError(
            f"key 'parallel.replicate' ({p.replicate}) needs parallel.backend=fsdp "
            f"(HSDP), got parallel.backend={p.backend}"
        )
    _check_tensor_parallel(config)


def _check_tensor_parallel(config: Config) -> None:
    p, m = config.parallel, config.model
    if p.tensor_parallel < 1:
        raise ConfigError(
            f"key 'parallel.tensor_parallel' got {p.tensor_parallel}, expected a positive integer"
        )
    bad = {k: v for k, v in p.tp_plan.items() if v not in ("colwise", "rowwise")}
    if bad:
        raise ConfigError(f"key 'parallel.tp_plan' got {bad}, expected colwise or rowwise")
    if p.tensor_parallel == 1:
        return
    if p.backend != "fsdp":
        raise ConfigError(
            f"key 'parallel.tensor_parallel' ({p.tensor_parallel}) needs parallel.backend=fsdp, "
            f"got parallel.backend={p.backend}"
        )
    if m.kind == "gpt":
        raise ConfigError(
            f"key 'parallel.tensor_parallel' ({p.tensor_parallel}) is not supported for "
            "model.kind=gpt yet (its fused attn.qkv and SwiGLU mlp.up do not split column-wise); "
            "use model.kind=hf with parallel.tp_plan, or parallel.replicate for a 2D mesh"
        )
    if not p.tp_plan:
        raise ConfigError(
            f"key 'parallel.tp_plan' is empty, but parallel.tensor_parallel={p.tensor_parallel} "
            "with model.kind=hf needs one: module name patterns -> colwise/rowwise, e.g. "
            "{'self_attn.[qkv]_proj': colwise, 'self_attn.o_proj': rowwise, "
            "'mlp.gate_proj': colwise, 'mlp.up_proj': colwise, 'mlp.down_proj': rowwise}"
        )
