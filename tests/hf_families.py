"""Tiny configs of the transformers families bigtrain trains by their declared plans (issue 53),
built here from each family's own config class: no download. Shared by the tests and
bench/families.py.

Every family gets the same small widths (vocabulary 384, d_model 64, 2 layers, 4 heads, 2 key/
value heads), plus what its architecture needs to be small and exercise its parts: a sliding
window layer for Gemma 3, four experts (two per token) for the MoE families, DeepSeek-V3's first
layer dense and its second MoE with a shared expert, and its MLA attention."""

from __future__ import annotations

from pathlib import Path
from typing import Any

COMMON: dict[str, Any] = {
    "vocab_size": 384,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen3": {"head_dim": 16},
    "gemma3_text": {
        "head_dim": 16,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    "olmo2": {},
    "phi3": {},
    "qwen3_moe": {
        "head_dim": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "decoder_sparse_step": 1,
    },
    "deepseek_v3": {
        "num_key_value_heads": 4,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "kv_lora_rank": 16,
        "q_lora_rank": None,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 16,
        "n_group": 1,
        "topk_group": 1,
    },
    "olmoe": {"num_experts": 4, "num_experts_per_tok": 2},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
}
"""model_type -> what its tiny config sets beyond COMMON."""

MOE = ("qwen3_moe", "deepseek_v3", "olmoe", "mixtral")


def tiny_config(model_type: str) -> dict[str, Any]:
    """The family's tiny config as model.hf_config takes it (with model_type)."""
    return {"model_type": model_type, **COMMON, **FAMILIES[model_type]}


def hf_config_override(model_type: str) -> str:
    """`model.hf_config={...}` for a config override list (OmegaConf's flow style)."""

    def flow(value: Any) -> str:
        if isinstance(value, list):
            return "[" + ", ".join(flow(v) for v in value) + "]"
        return "null" if value is None else str(value)

    items = ", ".join(f"{k}: {flow(v)}" for k, v in tiny_config(model_type).items())
    return "model.hf_config={" + items + "}"


def save_hub_dir(model_type: str, path: Path, seed: int = 0) -> Path:
    """The family's tiny model with seeded random weights, saved by transformers'
    `save_pretrained` into `path` as a Hub directory is laid out (MoE experts one tensor per
    expert); what `model.init_from` reads."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    options = tiny_config(model_type)
    torch.manual_seed(seed)
    config = AutoConfig.for_model(options.pop("model_type"), **options)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    params = {n for n, _ in model.named_parameters()}
    with torch.no_grad():  # persistent buffers (DeepSeek-V3's score correction) not zeros
        for name, tensor in model.state_dict().items():
            if name not in params and tensor.is_floating_point():
                tensor.copy_(torch.randn(tensor.shape) * 0.1)
    model.save_pretrained(path)
    return path


def hub_fingerprint(path: Path) -> str:
    """The weights fingerprint (the `init_from` event's) of a Hub directory as transformers
    itself loads it."""
    import torch
    from transformers import AutoModelForCausalLM

    from bigtrain.model.hf import HFCausalLM
    from bigtrain.parallel.backends.base import weights_fingerprint
    from bigtrain.utils.names import canonical_name

    model = HFCausalLM(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    return weights_fingerprint(
        (canonical_name(n), lambda p=p: p) for n, p in model.named_parameters()
    )


PROMPT = "The king"


def round_trip(checkpoint: Path, hub: Path, out: Path) -> dict[str, Any]:
    """A trained checkpoint of a family started from `hub` back to a Hub directory and into
    generation, through bigtrain's own commands (in this process): `bigtrain export --hf
    --check` (its JSON result), the exported tensor names against `hub`'s, and the greedy ids of
    `bigtrain generate` against transformers' own `generate` on the exported directory, and
    the exported tensors equal to `hub`'s (`unchanged`: those training does not change)."""
    import contextlib
    import io
    import json
    import logging

    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from bigtrain.cli import main
    from bigtrain.data.prepare.cache import load_tokenizer
    from bigtrain.model.generate import encode_prompt

    def cli(*argv: str) -> tuple[int, str]:
        """The CLI in this process; the console handler it sets on the "bigtrain" logger is taken
        off again (a module-scoped fixture runs before conftest's restore_bigtrain_logging)."""
        logger = logging.getLogger("bigtrain")
        handlers, level = list(logger.handlers), logger.level
        stdout = io.StringIO()
        try:
            with contextlib.redirect_stdout(stdout):
                code = main(list(argv))
        finally:
            logger.handlers[:], logger.level = handlers, level
        return code, stdout.getvalue()

    def tensors(directory: Path) -> dict[str, torch.Tensor]:
        with safe_open(str(directory / "model.safetensors"), "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)

    exported = out / "export"
    code, text = cli("export", str(checkpoint), "--hf", str(exported), "--check")
    check = json.loads(text.strip().splitlines()[-1]) if code in (0, 1) else {}
    code_gen, text = cli(
        "generate", str(checkpoint), "--prompt", PROMPT, "--temperature", "0",
        "--max-new-tokens", "8", "--json",
    )  # fmt: skip
    ours = json.loads(text.strip().splitlines()[-1])["tokens"] if code_gen == 0 else None
    tokenizer = load_tokenizer(str(exported))
    ids = torch.tensor([encode_prompt(tokenizer, PROMPT)])
    hf = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    eos = tokenizer.eos_token_id
    theirs = hf.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
        eos_token_id=eos, pad_token_id=eos,
    )[0, ids.shape[1] :].tolist()  # fmt: skip
    if theirs and theirs[-1] == eos:
        theirs = theirs[:-1]
    ours_t, hub_t = tensors(exported), tensors(hub)
    return {
        "export": code,
        "check": check.get("check", {}),
        "same_names": set(ours_t) == set(hub_t),
        "unchanged": sorted(
            k for k, t in ours_t.items() if k in hub_t and torch.equal(t, hub_t[k])
        ),
        "generate": code_gen,
        "ours": ours,
        "theirs": theirs,
    }
