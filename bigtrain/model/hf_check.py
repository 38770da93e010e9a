"""Does a Hugging Face directory's config.json describe the model a mapping writes? Every key
that changes what the weights compute is compared (shapes alone would pass an untied head,
another rope theta, norm eps or activation); a difference is a ConfigError naming the model.* key
that sets it."""

from __future__ import annotations

import math
from typing import Any

from bigtrain.errors import ConfigError
from bigtrain.model.hf_mapping import GPT2_NEEDS, LLAMA_NEEDS, HFMapping

# The config.json keys that change what the weights compute, with the model.* key that sets each.
CHECKED_KEYS = {
    "GPT2LMHeadModel": {
        "n_embd": "model.d_model",
        "n_layer": "model.n_layers",
        "n_head": "model.n_heads",
        "n_inner": "model.d_ff",
        "activation_function": "model.mlp (gelu = tanh-approximated GELU)",
        "layer_norm_epsilon": "model.norm_eps",
        "tie_word_embeddings": "model.tie_embeddings",
        "scale_attn_by_inverse_layer_idx": "-",
        "reorder_and_upcast_attn": "-",
    },
    "LlamaForCausalLM": {
        "hidden_size": "model.d_model",
        "num_hidden_layers": "model.n_layers",
        "num_attention_heads": "model.n_heads",
        "num_key_value_heads": "model.n_kv_heads",
        "intermediate_size": "model.d_ff",
        "head_dim": "model.d_model / model.n_heads",
        "hidden_act": "model.mlp",
        "rms_norm_eps": "model.norm_eps",
        "rope": "model.rope_theta (scaled rotary embeddings are not supported)",
        "tie_word_embeddings": "model.tie_embeddings",
        "attention_bias": "model.bias",
        "mlp_bias": "model.bias",
    },
    "MixtralForCausalLM": {
        "hidden_size": "model.d_model",
        "num_hidden_layers": "model.n_layers",
        "num_attention_heads": "model.n_heads",
        "num_key_value_heads": "model.n_kv_heads",
        "intermediate_size": "model.moe.d_expert",
        "head_dim": "model.d_model / model.n_heads",
        "hidden_act": "model.mlp",
        "rms_norm_eps": "model.norm_eps",
        "rope": "model.rope_theta (scaled rotary embeddings are not supported)",
        "tie_word_embeddings": "model.tie_embeddings",
        "num_local_experts": "model.moe.experts",
        "num_experts_per_tok": "model.moe.top_k",
        "sliding_window": "- (bigtrain's attention is not windowed)",
    },
}
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


def _normalised(config: dict[str, Any], key: str) -> Any:
    """A config value as it acts: defaults filled in, equivalent spellings merged."""
    if key == "n_inner":
        return config.get("n_inner") or 4 * config["n_embd"]
    if key == "activation_function":
        return "tanh-gelu" if config.get(key) in TANH_GELUS else config.get(key)
    if key == "head_dim":
        return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if key == "rope":  # transformers 5 keeps it in rope_parameters, older ones at the top
        params = config.get("rope_parameters") or config.get("rope_scaling") or {}
        theta = params.get("rope_theta", config.get("rope_theta"))
        return (float(theta) if theta is not None else None, params.get("rope_type", "default"))
    value = config.get(key)
    return float(value) if isinstance(value, float) else value


def check_hf_config(mapping: HFMapping, found: dict[str, Any], origin: str) -> None:
    """The Hugging Face config `found` (a directory's config.json, defaults filled in) describes
    the model this mapping writes: every key that changes what the weights compute agrees, or a
    ConfigError names each difference and the model.* key that sets it. Shapes alone would pass
    an untied head, another rope theta, norm eps or activation."""
    _check_model_type(mapping, found, origin)
    keys = CHECKED_KEYS.get(mapping.architecture, {})
    diffs = []
    for key, setting in keys.items():
        want, have = _normalised(mapping.config, key), _normalised(found, key)
        same = (
            math.isclose(want, have, rel_tol=1e-6)
            if isinstance(want, float) and isinstance(have, float)
            else want == have
        )
        if not same:
            diffs.append(f"{key} {have!r} there, {want!r} here ({setting})")
    if diffs:
        raise ConfigError(
            f"{origin} holds another model than this config builds: {'; '.join(diffs)}"
        )


STYLES = {
    "gpt2": GPT2_NEEDS,
    "llama": LLAMA_NEEDS,
    "mixtral": {**LLAMA_NEEDS, "moe.experts": "<num_local_experts>", "moe.top_k": "<k>"},
}
"""The model.* settings of bigtrain's GPT that build each transformers model type."""


def _check_model_type(mapping: HFMapping, found: dict[str, Any], origin: str) -> None:
    """Another transformers model type than this mapping writes: a ConfigError naming both and
    the settings that build the directory's model (their keys differ, so no key compares)."""
    want, have = mapping.config.get("model_type"), found.get("model_type")
    if have == want:
        return
    architecture = (found.get("architectures") or [f"model_type {have!r}"])[0]
    if have in STYLES:
        settings = " ".join(f"model.{k}={v}" for k, v in STYLES[have].items())
        fix = f"build that with {settings}, or read it as it is with model.kind=hf"
    else:
        fix = "read it with model.kind=hf"
    raise ConfigError(
        f"{origin} holds a {architecture} (model_type {have!r}), but this config builds a "
        f"{mapping.architecture} (model_type {want!r}): {fix}"
    )
