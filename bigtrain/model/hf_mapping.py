"""The one mapping between bigtrain's tensors and a transformers model's: names, splits, row ranges.

A `HFMapping` says where each bigtrain parameter lies in a transformers (HF) tensor (the whole of
one, or a row range of GPT-2's c_attn, which holds q, k and v), so that the same table serves both
directions: exporting bigtrain weights to a transformers directory
(`bigtrain.checkpoint.hf_export`) and reading a transformers checkpoint into bigtrain's GPT. Two mappings
exist for the built-in GPT (`mapping_for`): GPT-2 (`GPT2LMHeadModel`) and Llama
(`LlamaForCausalLM`). A `model.kind=hf` model maps onto its own class (`mapping_for_hf`): by
identity, except where transformers' own checkpoint conversion keeps another layout on disk
than in memory, such as the experts of MoE families (stacked `gate_up_proj` in memory, one
`gate_proj`/`up_proj`/`down_proj` per expert in a Hub directory).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from bigtrain.config.schema import ModelConfig
from bigtrain.errors import ConfigError
from bigtrain.model.gpt import default_d_ff

Shape = tuple[int, ...]

GPT2_NEEDS = {"position": "learned", "norm": "layernorm", "mlp": "gelu"}
LLAMA_NEEDS = {"position": "rope", "norm": "rmsnorm", "mlp": "swiglu"}


@dataclass(frozen=True)
class Part:
    """Where a bigtrain tensor lies in an HF tensor: `rows` consecutive rows from `offset`, in
    bigtrain orientation (the columns of a transposed Conv1D weight)."""

    hf_name: str
    """The tensor's name in the transformers state dict (and in the safetensors files)."""
    rows: int
    """Rows of the bigtrain tensor (the element count for 1-D tensors)."""
    transpose: bool = False
    """The HF tensor is the transpose of the bigtrain orientation (GPT-2's Conv1D stores
    (in, out))."""
    offset: int = 0
    """Rows of the HF tensor before this part's: GPT-2's `c_attn` holds q, k and v at 0, d_model
    and d_model + kv width; every other part covers its HF tensor whole."""
    experts: bool = False
    """A stack of `rows` experts (bigtrain's (experts, in, out)), each its own nn.Linear weight
    (out, in) in the HF files: `hf_name` has an `{e}` for the expert's index (Mixtral)."""
    joined: tuple[str, ...] = ()
    """An expert stack of a transformers MoE family (`experts` set): expert e's slice is its HF
    tensors `joined[j].format(e=e)` concatenated on their first dim, as they are (no
    transpose): the gate and up projections of `gate_up_proj`, the down projection alone."""

    def expert_names(self) -> list[str]:
        """The HF tensors of an expert stack, in expert order."""
        return [n for e in range(self.rows) for n in self.expert_parts(e)]

    def expert_parts(self, e: int) -> list[str]:
        """The HF tensors of expert `e`, in the order they make its slice."""
        return [t.format(e=e) for t in self.joined] or [self.hf_name.format(e=e)]

    def expert_slice(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """Expert e's slice of the stack from its HF tensors (expert_parts(e)'s)."""
        return torch.cat(tensors) if self.joined else tensors[0].T

    def expert_tensors(self, expert: torch.Tensor) -> list[torch.Tensor]:
        """The inverse of expert_slice: the HF tensors of one expert's slice."""
        if not self.joined:
            return [expert.T.contiguous()]
        return [t.contiguous() for t in expert.chunk(len(self.joined))]


@dataclass
class HFMapping:
    """How a bigtrain model's tensors map onto a transformers model's.

    For every bigtrain name, with `p = parts[name]` and `t = hf[p.hf_name].T if p.transpose else
    hf[p.hf_name]`: `tensor == t[p.offset : p.offset + p.rows]` (see `join`; `split` is the
    inverse). The bigtrain tensors of one HF tensor come one after another, in row order."""

    architecture: str
    """transformers class the weights are for, e.g. `GPT2LMHeadModel`, `LlamaForCausalLM`."""
    config: dict[str, Any]
    """The contents of config.json: made by transformers' own config class, so AutoConfig reads
    it back. Token ids (bos/eos/pad) are None here; the export fills them from the tokenizer."""
    shapes: dict[str, Shape]
    """Shape of each bigtrain tensor, by canonical name, in the order tensors are written."""
    parts: dict[str, Part]
    """Bigtrain canonical name -> where it lies in an HF tensor."""
    extra: dict[str, Shape] = field(default_factory=dict)
    """HF tensors with no bigtrain counterpart, written as zeros (GPT-2's biases when
    model.bias=false); a reader ignores them."""

    def hf_shapes(self) -> dict[str, Shape]:
        """Every HF tensor written, with its shape, in the order `split` produces them."""
        rows = hf_rows(self.parts)
        out: dict[str, Shape] = {}
        for name, shape in self.shapes.items():
            part = self.parts[name]
            if part.experts:
                inner = shape[1:] if part.joined else shape[:0:-1]
                if part.joined:
                    inner = (inner[0] // len(part.joined), *inner[1:])
                out.update(dict.fromkeys(part.expert_names(), inner))
                continue
            whole = (rows[part.hf_name], *shape[1:]) if shape else ()
            out[part.hf_name] = whole[::-1] if part.transpose else whole
        out.update(self.extra)
        return out

    def split(
        self, tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The HF tensors made of bigtrain tensors `(name, tensor)`, given in `shapes` order (one
        at a time: an iterator streams), each contiguous with its own storage (safetensors
        refuses tensors that share memory). An HF tensor of several bigtrain tensors (GPT-2's
        c_attn) is assembled and comes once its last part is given; `extra` is not produced."""
        rows = hf_rows(self.parts)
        assembling: tuple[str, torch.Tensor, int] | None = None  # (HF name, tensor, rows filled)
        for name, tensor in tensors:
            if tuple(tensor.shape) != self.shapes[name]:
                raise ConfigError(
                    f"tensor '{name}' was read with shape {tuple(tensor.shape)}, the mapping was "
                    f"made for {self.shapes[name]}"
                )
            part = self.parts[name]
            if part.experts:  # one Linear weight (or a few) per expert
                for e, expert in enumerate(tensor):
                    yield from zip(part.expert_parts(e), part.expert_tensors(expert), strict=True)
                continue
            if part.rows == rows[part.hf_name]:  # the whole HF tensor (also 0-d ones)
                piece = tensor.T if part.transpose else tensor
                yield part.hf_name, piece.clone(memory_format=torch.contiguous_format)
                continue
            if assembling is None:
                whole = torch.empty((rows[part.hf_name], *tensor.shape[1:]), dtype=tensor.dtype)
                assembling = (part.hf_name, whole, 0)
            hf_name, whole, filled = assembling
            assert (hf_name, filled) == (part.hf_name, part.offset), "parts come in row order"
            whole[filled : filled + part.rows] = tensor
            assembling = (hf_name, whole, filled + part.rows)
            if filled + part.rows == rows[hf_name]:
                yield hf_name, (whole.T if part.transpose else whole).contiguous()
                assembling = None
        assert assembling is None, f"'{assembling and assembling[0]}' lacks its last rows"

    def join(self, name: str, read_hf: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """Bigtrain tensor `name` rebuilt from its HF tensor (`read_hf(hf_name)`)."""
        part = self.parts[name]
        if part.experts:
            return torch.stack(
                [
                    part.expert_slice([read_hf(n) for n in part.expert_parts(e)])
                    for e in range(part.rows)
                ]
            )
        t = read_hf(part.hf_name)
        t = t.T if part.transpose else t
        if t.dim():  # 0-d tensors are whole
            t = t[part.offset : part.offset + part.rows]
        return t.clone(memory_format=torch.contiguous_format)


def hf_rows(parts: dict[str, Part]) -> dict[str, int]:
    """Rows of each HF tensor (in bigtrain orientation): the parts in it, which tile it in
    order."""
    rows: dict[str, int] = {}
    for part in parts.values():
        assert rows.get(part.hf_name, 0) == part.offset, f"parts of '{part.hf_name}' tile it"
        rows[part.hf_name] = part.offset + part.rows
    return rows


def mapping_for(cfg: ModelConfig, shapes: dict[str, Shape]) -> HFMapping:
    """The transformers mapping of bigtrain's GPT built from `cfg`, whose tensors have `shapes`
    (canonical parameter names, as `named_parameters` gives them: a tied `lm_head.weight` is
    absent, or ignored when present). GPT-2 for learned positions, LayerNorm and GELU; Llama for
    rotary positions, RMSNorm and SwiGLU; any other combination is a ConfigError."""
    if cfg.kind != "gpt":
        raise ConfigError(f"model.kind={cfg.kind}: mapping_for maps the built-in GPT only")
    shapes = {n: tuple(s) for n, s in shapes.items()}
    if cfg.tie_embeddings:
        shapes.pop("lm_head.weight", None)  # the same tensor as tok_emb.weight: written once
    if "tok_emb.weight" not in shapes:
        raise ConfigError("the tensors given have no 'tok_emb.weight' (not a bigtrain GPT)")
    vocab_size = shapes["tok_emb.weight"][0]
    extra: dict[str, Shape] = {}
    if _mismatches(cfg, GPT2_NEEDS) == [] and cfg.n_kv_heads in (None, cfg.n_heads):
        architecture, config = "GPT2LMHeadModel", _gpt2_config(cfg, vocab_size)
        parts, extra = _gpt2_parts(cfg, vocab_size)
    elif _mismatches(cfg, LLAMA_NEEDS) == [] and cfg.moe.experts:
        architecture, config = "MixtralForCausalLM", _mixtral_config(cfg, vocab_size)
        parts = _mixtral_parts(cfg, _llama_parts(cfg, vocab_size))
    elif _mismatches(cfg, LLAMA_NEEDS) == []:
        architecture, config = "LlamaForCausalLM", _llama_config(cfg, vocab_size)
        parts = _llama_parts(cfg, vocab_size)
    else:
        raise ConfigError(_no_mapping_message(cfg))
    _check_covers(parts, shapes)
    ordered = {n: shapes[n] for n in parts}  # tensors are read and written in the mapping's order
    return HFMapping(architecture, config, ordered, parts, extra)


def _mismatches(cfg: ModelConfig, needs: dict[str, str]) -> list[str]:
    return [
        f"model.{key}={value} (have {getattr(cfg, key)})"
        for key, value in needs.items()
        if getattr(cfg, key) != value
    ]


def _no_mapping_message(cfg: ModelConfig) -> str:
    gpt2 = _mismatches(cfg, GPT2_NEEDS)
    if cfg.n_kv_heads not in (None, cfg.n_heads):
        gpt2.append(f"model.n_kv_heads=null or n_heads (have {cfg.n_kv_heads})")
    llama = _mismatches(cfg, LLAMA_NEEDS)
    return (
        "no transformers mapping for this model: GPT2LMHeadModel needs "
        + ", ".join(gpt2)
        + "; LlamaForCausalLM needs "
        + ", ".join(llama)
    )


def _check_covers(parts: dict[str, Part], shapes: dict[str, Shape]) -> None:
    """Every given tensor is mapped, every mapped tensor is given, and the rows add up."""
    missing = [n for n in parts if n not in shapes]
    unexpected = [n for n in shapes if n not in parts]
    if missing or unexpected:
        raise ConfigError(
            f"the tensors do not match the model config: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    for name, shape in shapes.items():
        rows = parts[name].rows
        if rows != shape[0]:
            raise ConfigError(
                f"tensor '{name}' has shape {shape}, the model config gives {rows} rows: the "
                "checkpoint was not made with this model config"
            )


def _widths(cfg: ModelConfig) -> tuple[int, int, int]:
    """(head_dim, key/value width, MLP hidden width) of the built-in GPT."""
    head_dim = cfg.d_model // cfg.n_heads
    return head_dim, (cfg.n_kv_heads or cfg.n_heads) * head_dim, cfg.d_ff or default_d_ff(cfg)


def _gpt2_parts(cfg: ModelConfig, vocab_size: int) -> tuple[dict[str, Part], dict[str, Shape]]:
    d, (_, kv_width, hidden) = cfg.d_model, _widths(cfg)
    parts: dict[str, Part] = {
        "tok_emb.weight": Part("transformer.wte.weight", vocab_size),
        "pos_emb.weight": Part("transformer.wpe.weight", cfg.seq_len),
    }
    extra: dict[str, Shape] = {}
    # (HF module, its bigtrain modules with their rows, Conv1D); GPT-2's Conv1D weights are
    # (in, out), and its c_attn holds q, k and v as columns [q | k | v].
    modules = []
    for i in range(cfg.n_layers):
        b, h = f"blocks.{i}", f"transformer.h.{i}"
        qkv = [(f"{b}.attn.q", d), (f"{b}.attn.k", kv_width), (f"{b}.attn.v", kv_width)]
        modules += [
            (f"{h}.ln_1", [(f"{b}.norm1", d)], False),
            (f"{h}.attn.c_attn", qkv, True),
            (f"{h}.attn.c_proj", [(f"{b}.attn.proj", d)], True),
            (f"{h}.ln_2", [(f"{b}.norm2", d)], False),
            (f"{h}.mlp.c_fc", [(f"{b}.mlp.up", hidden)], True),
            (f"{h}.mlp.c_proj", [(f"{b}.mlp.down", d)], True),
        ]
    modules.append(("transformer.ln_f", [("norm_f", d)], False))
    for theirs, ours, conv in modules:
        params = [("weight", conv), ("bias", False)] if cfg.bias else [("weight", conv)]
        for param, transpose in params:  # each HF tensor's parts one after another
            offset = 0
            for module, rows in ours:
                parts[f"{module}.{param}"] = Part(f"{theirs}.{param}", rows, transpose, offset)
                offset += rows
        if not cfg.bias:
            # GPT-2 always has biases (no config switch). Zeros compute what no bias does;
            # left out, transformers reports them MISSING ("newly initialized") on every load
            # (it happens to zero them) and stricter readers refuse the checkpoint.
            extra[f"{theirs}.bias"] = (offset,)
    if not cfg.tie_embeddings:
        parts["lm_head.weight"] = Part("lm_head.weight", vocab_size)
    return parts, extra


def _gpt2_config(cfg: ModelConfig, vocab_size: int) -> dict[str, Any]:
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=vocab_size,
        n_positions=cfg.seq_len,
        n_embd=cfg.d_model,
        n_layer=cfg.n_layers,
        n_head=cfg.n_heads,
        n_inner=_widths(cfg)[2],
        activation_function="gelu_new",  # the tanh approximation, as bigtrain's MLP computes
        layer_norm_epsilon=cfg.norm_eps,
        # The export is for inference: dropout off whatever model.dropout trained with.
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        summary_first_dropout=0.0,
        tie_word_embeddings=cfg.tie_embeddings,
        bos_token_id=None,
        eos_token_id=None,
        architectures=["GPT2LMHeadModel"],
        dtype="float32",
    ).to_dict()


def _llama_parts(cfg: ModelConfig, vocab_size: int) -> dict[str, Part]:
    d, (_, kv_width, hidden) = cfg.d_model, _widths(cfg)
    parts: dict[str, Part] = {"tok_emb.weight": Part("model.embed_tokens.weight", vocab_size)}
    params = ("weight", "bias") if cfg.bias else ("weight",)
    for i in range(cfg.n_layers):
        b, h = f"blocks.{i}", f"model.layers.{i}"
        parts[f"{b}.norm1.weight"] = Part(f"{h}.input_layernorm.weight", d)
        for p in params:
            parts[f"{b}.attn.q.{p}"] = Part(f"{h}.self_attn.q_proj.{p}", d)
            parts[f"{b}.attn.k.{p}"] = Part(f"{h}.self_attn.k_proj.{p}", kv_width)
            parts[f"{b}.attn.v.{p}"] = Part(f"{h}.self_attn.v_proj.{p}", kv_width)
            parts[f"{b}.attn.proj.{p}"] = Part(f"{h}.self_attn.o_proj.{p}", d)
        parts[f"{b}.norm2.weight"] = Part(f"{h}.post_attention_layernorm.weight", d)
        for p in params:
            parts[f"{b}.mlp.gate.{p}"] = Part(f"{h}.mlp.gate_proj.{p}", hidden)
            parts[f"{b}.mlp.up.{p}"] = Part(f"{h}.mlp.up_proj.{p}", hidden)
            parts[f"{b}.mlp.down.{p}"] = Part(f"{h}.mlp.down_proj.{p}", d)
    parts["norm_f.weight"] = Part("model.norm.weight", d)
    if not cfg.tie_embeddings:
        parts["lm_head.weight"] = Part("lm_head.weight", vocab_size)
    return parts


def _mixtral_parts(cfg: ModelConfig, llama: dict[str, Part]) -> dict[str, Part]:
    """Llama's parts with every block's MLP a mixture of experts: its router is `gate`, expert
    e's gate, down and up projections are `w1`, `w2` and `w3` (the Hub's Mixtral layout, which
    transformers 5 fuses on load and splits on save)."""
    e = cfg.moe.experts
    parts = {n: p for n, p in llama.items() if ".mlp." not in n}
    for i in range(cfg.n_layers):
        b, h = f"blocks.{i}.moe", f"model.layers.{i}.block_sparse_moe"
        parts[f"{b}.router.weight"] = Part(f"{h}.gate.weight", e)
        for ours, theirs in (("w_gate", "w1"), ("w_up", "w3"), ("w_down", "w2")):
            parts[f"{b}.experts.{ours}"] = Part(
                f"{h}.experts.{{e}}.{theirs}.weight", e, experts=True
            )
    return dict(sorted(parts.items(), key=lambda item: _block_order(item[0])))


def _block_order(name: str) -> tuple[int, str]:
    """Tensors block by block, as Llama's order has them (the experts after a block's norms)."""
    if name.startswith("blocks."):
        return int(name.split(".")[1]) + 1, name
    return (0 if name == "tok_emb.weight" else 1 << 30), name


def _llama_kwargs(cfg: ModelConfig, vocab_size: int, hidden: int) -> dict[str, Any]:
    """What a Llama-family transformers config (Llama, Mixtral) takes from bigtrain's GPT."""
    return dict(
        vocab_size=vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=hidden,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads or cfg.n_heads,
        head_dim=cfg.d_model // cfg.n_heads,
        hidden_act="silu",
        max_position_embeddings=cfg.seq_len,
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta,
        attention_dropout=0.0,  # the export is for inference
        tie_word_embeddings=cfg.tie_embeddings,
        bos_token_id=None,
        eos_token_id=None,
        dtype="float32",
    )


def _llama_config(cfg: ModelConfig, vocab_size: int) -> dict[str, Any]:
    from transformers import LlamaConfig

    return LlamaConfig(
        **_llama_kwargs(cfg, vocab_size, _widths(cfg)[2]),
        attention_bias=cfg.bias,
        mlp_bias=cfg.bias,
        architectures=["LlamaForCausalLM"],
    ).to_dict()


MIXTRAL_NEEDS = {
    "every": 1,
    "first": 0,
    "shared_experts": 0,
    "score": "softmax",
    "normalize_weights": True,
    "capacity_factor": 0.0,
}
"""The model.moe settings of a Mixtral (besides Llama's)."""


def _mixtral_config(cfg: ModelConfig, vocab_size: int) -> dict[str, Any]:
    """Mixtral: Llama style, every block a mixture of softmax-routed experts whose top-k weights
    are renormalised, no shared expert; ConfigError naming each model.moe setting it lacks."""
    from transformers import MixtralConfig

    wrong = [
        f"model.moe.{key}={value} (have {getattr(cfg.moe, key)})"
        for key, value in MIXTRAL_NEEDS.items()
        if getattr(cfg.moe, key) != value
    ]
    if wrong:
        raise ConfigError(
            "no transformers mapping for this MoE model: MixtralForCausalLM, the Hub's MoE "
            "layout, has no dense block (every block MoE), no shared expert and no capacity, "
            "and routes by softmax with renormalised weights; it needs " + ", ".join(wrong)
        )
    return MixtralConfig(
        **_llama_kwargs(cfg, vocab_size, cfg.moe.d_expert or _widths(cfg)[2]),
        sliding_window=None,
        num_local_experts=cfg.moe.experts,
        num_experts_per_tok=cfg.moe.top_k,
        router_aux_loss_coef=cfg.moe.aux_loss_coef,
        router_jitter_noise=0.0,
        architectures=["MixtralForCausalLM"],
    ).to_dict()


def mapping_for_hf(hf_config, shapes: dict[str, Shape]) -> HFMapping:
    """The mapping of a `model.kind=hf` model (bigtrain's `HFCausalLM`): `hf.<name>` is the
    transformers tensor `<name>`, written for the class transformers builds from `hf_config`.
    `shapes` are canonical parameter names as `named_parameters` gives them; when the config ties
    the output embedding, its tied copy is dropped if present (written once, as save_pretrained
    does). Persistent buffers are not parameters and are not written."""
    from transformers import AutoModelForCausalLM

    # The class AutoModelForCausalLM built (bigtrain.model.hf), which config.architectures may
    # not name: a base model's directory says e.g. LlamaModel.
    cls = AutoModelForCausalLM._model_mapping.get(type(hf_config), None)
    if cls is not None:
        architecture = cls.__name__
    elif hf_config.architectures:
        architecture = hf_config.architectures[0]
    else:
        raise ConfigError(f"model.hf_config: {type(hf_config).__name__} has no causal LM class")
    names = {n.removeprefix("hf."): tuple(s) for n, s in shapes.items() if n.startswith("hf.")}
    if len(names) != len(shapes):
        raise ConfigError("mapping_for_hf: every tensor name starts with 'hf.' (an HFCausalLM)")
    if getattr(hf_config, "tie_word_embeddings", False):
        # transformers 5 maps each tied tensor to its source; 4.x lists the tied tensors only
        tied = getattr(cls, "_tied_weights_keys", None) or {}
        pairs = tied.items() if isinstance(tied, dict) else ((t, None) for t in tied)
        for target, source in pairs:
            if source is None or source in names:
                names.pop(target, None)
    config = hf_config.to_dict()
    config.pop("_name_or_path", None)  # where the model was loaded from: a local path, maybe
    config.update(architectures=[architecture], dtype="float32")
    parts = hub_parts(hf_config, names)
    return HFMapping(
        architecture,
        config,
        {f"hf.{n}": s for n, s in names.items()},
        {f"hf.{n}": part for n, part in parts.items()},
    )


def hub_parts(hf_config, names: dict[str, Shape]) -> dict[str, Part]:
    """Where each tensor of a transformers model (by its name in memory) lies in the model's
    directory as `save_pretrained` writes it: transformers' own reverse checkpoint conversion
    (`revert_weight_conversion`), run tensor by tensor on the meta device, gives the names and
    shapes on disk. A tensor saved as itself or renamed (Mixtral's `block_sparse_moe`) is a
    plain part; one saved as one tensor per expert is an expert stack (`Part.joined`), checked
    against transformers' conversion of a small probe. Any other layout is a ConfigError naming
    the family and the tensor."""
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    parts = {}
    for name, shape in names.items():
        disk = revert_weight_conversion(model, {name: torch.empty(shape, device="meta")})
        if len(disk) == 1:
            ((disk_name, tensor),) = disk.items()
            if tuple(tensor.shape) == shape:
                parts[name] = Part(disk_name, shape[0] if shape else 1)
                continue
        parts[name] = _expert_stack(
            model, name, shape, {k: tuple(v.shape) for k, v in disk.items()}
        )
    return parts


def _expert_stack(model, name: str, shape: Shape, disk: dict[str, Shape]) -> Part:
    """The Part of a stacked experts tensor saved as `disk` (hub_parts): each expert's slice the
    concatenation of a few per-expert tensors, found by converting a probe of 2 experts whose
    values say where each element came from."""
    from transformers.core_model_loading import revert_weight_conversion

    def refuse(why: str) -> ConfigError:
        return ConfigError(
            f"the transformers family {model.config.model_type!r} saves '{name}' {shape} as "
            f"{len(disk)} tensors ({next(iter(disk))}, ...) that bigtrain cannot map: {why}"
        )

    experts, pieces = shape[0] if shape else 0, len(disk) // max(shape[0] if shape else 1, 1)
    if not experts or len(disk) != experts * pieces or len(shape) < 2 or shape[1] % pieces:
        raise refuse("not a few tensors per expert")
    probe = torch.arange(2 * pieces * 3 * 5, dtype=torch.float32).reshape(2, pieces * 3, 5)
    probe = probe[..., 0] if len(shape) == 2 else probe
    templates: dict[int, list[str]] = {}
    for key, tensor in revert_weight_conversion(model, {name: probe}).items():
        where = [
            (e, j)
            for e in range(2)
            for j, chunk in enumerate(probe[e].chunk(pieces))
            if chunk.shape == tensor.shape and torch.equal(chunk, tensor)
        ]
        if len(where) != 1:
            raise refuse(f"{key} is not one expert's piece of it")
        templates.setdefault(where[0][1], [None, None])[where[0][0]] = key  # type: ignore[list-item]
    joined = []
    for j in range(pieces):
        first, second = templates.get(j) or (None, None)
        a, b = str(first).split("."), str(second).split(".")
        differ = [i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y]
        if len(a) != len(b) or len(differ) != 1 or (a[differ[0]], b[differ[0]]) != ("0", "1"):
            raise refuse(f"no expert index between {first} and {second}")
        a[differ[0]] = "{e}"
        joined.append(".".join(a))
    part = Part(joined[0], experts, experts=True, joined=tuple(joined))
    if set(part.expert_names()) != set(disk):
        raise refuse("its tensors are not one per expert and piece")
    return part
