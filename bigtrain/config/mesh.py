"""Checks of the mesh keys (parallel.replicate, tensor_parallel, tp_plan) against the backend
and the model; the world size is checked at start (parallel/mesh.py)."""

from __future__ import annotations

from bigtrain.config.schema import Config, ModelConfig, default_d_ff
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
    bad = {k: v for k, v in p.tp_plan.items() if v not in ("colwise", "rowwise", "colwise_qkv")}
    if bad:
        raise ConfigError(
            f"key 'parallel.tp_plan' got {bad}, expected colwise, rowwise or colwise_qkv"
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
    if not p.tp_plan:
        raise ConfigError(
            f"key 'parallel.tp_plan' is empty, but parallel.tensor_parallel={p.tensor_parallel} "
            "with model.kind=hf needs one: module name patterns -> colwise/rowwise, e.g. "
            "{'self_attn.[qkv]_proj': colwise, 'self_attn.o_proj': rowwise, "
            "'mlp.gate_proj': colwise, 'mlp.up_proj': colwise, 'mlp.down_proj': rowwise}"
        )


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
