"""The `model.*` section: bigtrain's GPT or a transformers model, and where its weights start;
its checks beyond the types (called by config/load.py's `validate`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from bigtrain.errors import ConfigError


@dataclass
class MoEConfig:
    """Mixture-of-experts blocks (bigtrain's GPT; docs/moe.md): the MLP of chosen blocks becomes
    `experts` MLPs of which a router picks `top_k` per token."""

    experts: int = 0
    """Routed experts per MoE block; 0: a dense model."""
    top_k: int = 2
    """Experts each token is sent to (token-choice routing)."""
    every: int = 1
    """Every n-th block (counted from `first`) is an MoE block; the others keep a dense MLP."""
    first: int = 0
    """Blocks before this index stay dense (DeepSeek keeps its first blocks dense)."""
    d_expert: int | None = None
    """Hidden width of each expert (SwiGLU or GELU as model.mlp). None: model.d_ff's default
    (a top-1 model then has the dense model's active parameters)."""
    shared_experts: int = 0
    """Experts every token goes through besides its routed ones (DeepSeek, Qwen-MoE), as one
    MLP of shared_experts x d_expert hidden units."""
    score: str = "softmax"
    """Router scores: `softmax` over the experts (Mixtral, OLMoE) or `sigmoid` per expert
    (DeepSeek-V3). The router is an FP32 island: logits and scores in FP32."""
    normalize_weights: bool = True
    """Rescale each token's top-k scores to sum to 1 (Mixtral); false keeps the raw scores
    (OLMoE, Qwen-MoE with norm_topk_prob false)."""
    aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss (Switch Transformer: experts x sum over experts of
    the fraction of routed tokens x the mean score; 1.0 when perfectly balanced), per MoE block,
    added to the training loss."""
    z_loss_coef: float = 0.001
    """Weight of the router z-loss (ST-MoE: the mean squared log-sum-exp of the router logits),
    which keeps the logits from growing."""
    capacity_factor: float = 0.0
    """0: dropless (every token reaches its experts). > 0: each expert takes at most
    capacity_factor x tokens x top_k / experts token slots per micro-batch; the rest are dropped
    (their routed output is 0, the residual carries them) and counted (`moe/dropped`)."""


@dataclass
class ModelConfig:
    kind: str = "gpt"
    """`gpt`: bigtrain's built-in GPT. `hf`: a transformers causal LM (see `hf_config`, `hf_path`).
    Read when the model is built; a change on resume is a config error."""
    n_layers: int = 4
    """Transformer blocks (gpt)."""
    n_heads: int = 4
    """Attention heads per block (gpt); must divide `d_model`."""
    n_kv_heads: int | None = None
    """Key/value heads (gpt): fewer than n_heads is grouped-query attention (Llama 2 70B, Llama 3);
    must divide n_heads. None: n_heads."""
    d_model: int = 128
    """Residual stream width (gpt)."""
    d_ff: int | None = None
    """MLP hidden width (gpt). None: 4 x d_model for GELU, 8/3 x d_model rounded to 64 for SwiGLU."""
    vocab_size: int | None = None
    """Embedding rows. None: the tokenizer's vocabulary size. Must be >= the tokenizer's size."""
    seq_len: int = 128
    """Tokens per training sequence (and the positional table size for learned positions)."""
    position: str = "learned"
    """`learned` (GPT-2) or `rope` (Llama) positions."""
    rope_theta: float = 10000.0
    """Base of the rotary frequencies (rope only)."""
    norm: str = "layernorm"
    """`layernorm` (GPT-2) or `rmsnorm` (Llama). Norms always compute in FP32."""
    norm_eps: float = 1e-5
    """Epsilon of every normalisation."""
    mlp: str = "gelu"
    """`gelu` (GPT-2) or `swiglu` (Llama)."""
    bias: bool = True
    """Biases in linear layers and LayerNorm (GPT-2 has them, Llama does not)."""
    tie_embeddings: bool = True
    """Share the token embedding with the output projection (`lm_head`)."""
    dropout: float = 0.0
    """Dropout on attention weights and residual branches; 0 keeps training deterministic."""
    init_std: float = 0.02
    """Std of the normal init; residual output projections are scaled by 1/sqrt(2 n_layers)."""
    hf_config: dict[str, Any] | None = None
    """kind=hf: a transformers config as a dict with `model_type` (e.g. gpt2, llama); built from
    scratch with random weights."""
    hf_path: str | None = None
    """kind=hf: a local directory holding `config.json` (and weights, which are then loaded), or a
    hub name. Takes precedence over `hf_config`."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """Mixture-of-experts blocks (kind=gpt); `model.moe.experts=0` keeps the model dense."""
    init_from: str | None = None
    """Start this run from existing weights: a Hugging Face model directory (`config.json` and
    safetensors, sharded or not; GPT-2 and Llama layouts map onto kind=gpt by name, any model onto
    kind=hf), or a bigtrain checkpoint of any backend and world size. Step 0, fresh optimizer
    state, data from the start, an `init_from` event with the source and a checksum. Each rank
    reads only the slices it keeps. Only when there is nothing to resume (a restarted job resumes
    its own checkpoints). At setup."""


def default_d_ff(cfg: ModelConfig) -> int:
    """The MLP's hidden width when model.d_ff is not set: 4 x d_model (GELU), or 8/3 x d_model
    rounded up to a multiple of 64 (SwiGLU, the same parameters in three matrices)."""
    if cfg.mlp == "swiglu":
        return 64 * math.ceil(8 * cfg.d_model / 3 / 64)
    return 4 * cfg.d_model


def moe_blocks(m: ModelConfig) -> list[int]:
    """The indices of the blocks whose MLP is a mixture of experts (none in a dense model)."""
    e = m.moe
    if m.kind != "gpt" or e.experts == 0:
        return []
    return [i for i in range(e.first, m.n_layers) if (i - e.first) % e.every == 0]


def check_moe(m: ModelConfig) -> None:
    """Mixture-of-experts settings that cannot work; ConfigError naming the key."""
    e = m.moe
    if e.experts < 0:
        raise ConfigError(f"key 'model.moe.experts' ({e.experts}) must be >= 0 (0: dense)")
    if e.experts == 0:
        return
    if m.kind != "gpt":
        raise ConfigError(
            "key 'model.moe.experts': bigtrain's MoE blocks are for model.kind=gpt; a "
            "transformers MoE model (Mixtral, Qwen-MoE, OLMoE) brings its own (model.hf_config)"
        )
    checks = [
        (
            e.top_k < 1 or e.top_k > e.experts,
            "top_k",
            f"between 1 and model.moe.experts ({e.experts})",
        ),
        (e.every < 1, "every", "at least 1"),
        (
            not 0 <= e.first < m.n_layers,
            "first",
            f"a block index below model.n_layers ({m.n_layers})",
        ),
        (e.d_expert is not None and e.d_expert < 1, "d_expert", "positive (or null)"),
        (e.shared_experts < 0, "shared_experts", ">= 0"),
        (e.score not in ("softmax", "sigmoid"), "score", "softmax or sigmoid"),
        (e.aux_loss_coef < 0, "aux_loss_coef", ">= 0"),
        (e.z_loss_coef < 0, "z_loss_coef", ">= 0"),
        (e.capacity_factor < 0, "capacity_factor", ">= 0 (0: dropless)"),
    ]
    for bad, key, expected in checks:
        if bad:
            value = getattr(e, key)
            raise ConfigError(f"key 'model.moe.{key}' ({value}) must be {expected}")


def check_model(m: ModelConfig) -> None:
    """What the model keys' types alone do not check."""
    check_moe(m)
    if m.kind == "gpt" and m.d_model % m.n_heads:
        raise ConfigError(
            f"key 'model.n_heads' ({m.n_heads}) must divide model.d_model ({m.d_model})"
        )
    if (
        m.kind == "gpt"
        and m.n_kv_heads is not None
        and (m.n_kv_heads <= 0 or m.n_heads % m.n_kv_heads)
    ):
        raise ConfigError(
            f"key 'model.n_kv_heads' ({m.n_kv_heads}) must be positive and divide model.n_heads "
            f"({m.n_heads})"
        )
    if m.kind == "gpt" and m.position == "rope" and (m.d_model // m.n_heads) % 2:
        raise ConfigError("key 'model.n_heads': rope needs an even head dim (d_model / n_heads)")
    if m.kind == "hf" and not (m.hf_config or m.hf_path or m.init_from):
        raise ConfigError(
            "model.kind=hf needs 'model.hf_config' (a dict), 'model.hf_path' or 'model.init_from' "
            "(a Hugging Face directory)"
        )
    if m.kind == "hf" and m.hf_config is not None and "model_type" not in m.hf_config:
        raise ConfigError(_hf_config_without_model_type(dict(m.hf_config)))


def _hf_config_without_model_type(got: dict[str, Any]) -> str:
    message = (
        f"key 'model.hf_config' must name its 'model_type' (e.g. gpt2, llama); the value was read "
        f"as YAML and gave the mapping {got}"
    )
    if any(":" in str(k) and v is None for k, v in got.items()):
        # YAML reads `{a:1}` as a key 'a:1' without a value: a key needs ': ' (colon, space)
        message += (
            "; in YAML a key and its value are separated by ': ' (colon and space), e.g. "
            "model.hf_config='{model_type: gpt2, n_layer: 2}'"
        )
    return message
