"""bigtrain's built-in GPT: architecture only.

GPT-2 style (learned positions, LayerNorm, GELU, biases) and Llama style (rotary positions,
RMSNorm, SwiGLU, no biases) from one config. Precision, sharding and checkpointing of activations
are applied from outside: the only precision knob here is `CausalSelfAttention.fp32_softmax`, a
module attribute that the precision policy sets after the model is built. For generation,
`forward(idx, cache)` with a `KVCache` feeds only the new tokens: the keys and values of the
earlier ones are kept, so each generated token costs one position, not the whole prefix.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from bigtrain.config.model import moe_blocks
from bigtrain.config.schema import ModelConfig, default_d_ff
from bigtrain.model.init import initial_value
from bigtrain.model.moe import MoE
from bigtrain.model.routed import routed_experts
from bigtrain.utils.tensors import autocast_off


class SequenceChunks(Protocol):
    """What the GPT asks of context parallelism (parallel/context/split.py's ContextSplit): this
    rank's chunks of a tensor holding whole sequences along `dim`, and their number."""

    degree: int

    def local(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor: ...


ChunkAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor
]
"""Context parallelism's attention (parallel/context/attention.py's ContextAttention): q, k, v
of this rank's chunks and the whole sequence's document numbers (or None) -> the output."""


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in FP32: the mean of squares loses digits in BF16/FP16.
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


class LayerNorm(nn.LayerNorm):
    """LayerNorm computed in FP32 whatever the autocast dtype, returned in the input dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.float() if self.weight is not None else None
        bias = self.bias.float() if self.bias is not None else None
        with autocast_off(x.device.type):
            y = F.layer_norm(x.float(), self.normalized_shape, weight, bias, self.eps)
        return y.to(x.dtype)


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.d_model, cfg.norm_eps)
    return LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)


def rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (batch, heads, seq, head_dim); cos/sin: (seq, head_dim / 2), or (batch, 1, seq, ...) with
    # positions per token; rotates the two halves of head_dim (GPT-NeoX layout).
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.to(x.dtype)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads or cfg.n_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        self.dropout = cfg.dropout
        kv_width = self.n_kv_heads * self.head_dim
        # Separate projections (not one fused [q; k; v]): tensor parallelism splits each by heads.
        self.q = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.k = nn.Linear(cfg.d_model, kv_width, bias=cfg.bias)
        self.v = nn.Linear(cfg.d_model, kv_width, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.proj.residual_scaled_init = True  # type: ignore[attr-defined]
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.fp32_softmax = False
        """Set by the precision policy: compute scores and softmax in FP32 (explicit path)."""
        self.context: ChunkAttention | None = None
        """Set by context parallelism (parallel/context/): attention over the whole sequence
        from this rank's chunks, in place of SDPA (its kernels keep the softmax in FP32)."""

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        mask: torch.Tensor | None = None,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        """mask: None (causal), or (batch, 1, seq, seq) booleans, True where attention is
        allowed (causal within each document, see GPT.document_eos). With a `cache`, x holds the
        new tokens only and mask is KVCache.mask's (None: one new token, which sees them all).
        Under context parallelism x holds this rank's chunks and mask is None or each token's
        document number over the whole sequence (batch, seq): `self.context` makes the masks.

        Head counts come from the projections' outputs: under tensor parallelism each rank holds
        its share of the heads (parallel/tensor/plans.py)."""
        batch, seq, _ = x.shape
        q, k, v = (
            t.view(batch, seq, -1, self.head_dim).transpose(1, 2)
            for t in (self.q(x), self.k(x), self.v(x))
        )
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if cache is not None:
            k, v = cache.extend(k, v)
        if self.context is not None:
            y = self.context(q, k, v, mask).transpose(1, 2).reshape(batch, seq, -1)
            return self.resid_dropout(self.proj(y))
        causal = mask is None and cache is None
        p = self.dropout if self.training else 0.0
        grouped = self.n_kv_heads != self.n_heads
        if self.fp32_softmax:
            if grouped:  # each key/value head serves n_heads / n_kv_heads query heads
                groups = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            y = self._explicit_fp32(q, k, v, p, mask, causal)
        else:
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal, enable_gqa=grouped
            )
        y = y.transpose(1, 2).reshape(batch, seq, -1)
        return self.resid_dropout(self.proj(y))

    def _explicit_fp32(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        p: float,
        mask: torch.Tensor | None,
        causal: bool,
    ) -> torch.Tensor:
        seq = q.shape[-2]
        if causal:
            mask = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
        with autocast_off(q.device.type):
            scores = (q.float() @ k.float().transpose(-2, -1)) / math.sqrt(self.head_dim)
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            probs = F.dropout(scores.softmax(dim=-1), p=p, training=p > 0)
        # The weighted sum of values goes back to the compute dtype like any other matmul.
        return probs.to(v.dtype) @ v


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, hidden: int | None = None) -> None:
        super().__init__()
        hidden = hidden or cfg.d_ff or default_d_ff(cfg)
        # SwiGLU: silu(gate(x)) * up(x); separate layers, which tensor parallelism splits alike.
        self.gate = nn.Linear(cfg.d_model, hidden, bias=cfg.bias) if cfg.mlp == "swiglu" else None
        self.up = nn.Linear(cfg.d_model, hidden, bias=cfg.bias)
        self.down = nn.Linear(hidden, cfg.d_model, bias=cfg.bias)
        self.down.residual_scaled_init = True  # type: ignore[attr-defined]
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is not None:
            h = F.silu(self.gate(x)) * self.up(x)
        else:
            h = F.gelu(self.up(x), approximate="tanh")
        return self.dropout(self.down(h))


def make_moe(cfg: ModelConfig) -> MoE:
    """An MoE block's MLP (model.moe): routed experts, and the shared experts as one MLP."""
    hidden = cfg.moe.d_expert or cfg.d_ff or default_d_ff(cfg)
    shared = MLP(cfg, cfg.moe.shared_experts * hidden) if cfg.moe.shared_experts else None
    return MoE(cfg.moe, cfg.d_model, hidden, cfg.mlp == "swiglu", shared)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0) -> None:
        """index: the block's place in the model, which decides whether it is an MoE block."""
        super().__init__()
        self.norm1 = make_norm(cfg)
        self.attn = CausalSelfAttention(cfg)
        self.norm2 = make_norm(cfg)
        sparse = index in moe_blocks(cfg)
        self.mlp = None if sparse else MLP(cfg)
        self.moe = make_moe(cfg) if sparse else None

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        mask: torch.Tensor | None = None,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        # cache by keyword: tensor parallelism prepares the positional inputs (x, rope, mask)
        x = x + self.attn(self.norm1(x), rope, mask, cache=cache)
        ffn = self.moe if self.moe is not None else self.mlp
        return x + ffn(self.norm2(x))


class TiedLinear(nn.Linear):
    """The bias-free output projection over the token embedding's table (tied weights). Built
    without nn.Linear's constructor, which would first make and draw a table of its own (vocab x
    d_model) only for the tie to drop it."""

    def __init__(self, weight: nn.Parameter, in_features: int, out_features: int) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = in_features, out_features
        self.weight = weight
        self.register_parameter("bias", None)

    def reset_parameters(self) -> None:
        """Nothing: the table is the embedding's."""


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig, init_seed: int | None = 0) -> None:
        """init_seed: the seed of the initial weights (train.seed; model/init.py). None leaves
        them undrawn, for builds whose parameters get their values later, one parameter at a
        time (on the meta device; partitioned by ZeRO-3)."""
        super().__init__()
        assert cfg.vocab_size is not None, (
            "vocab_size is resolved from the tokenizer before building"
        )
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model) if cfg.position == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm_f = make_norm(cfg)
        if cfg.tie_embeddings:
            self.lm_head = TiedLinear(self.tok_emb.weight, cfg.d_model, cfg.vocab_size)
        else:
            self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.position == "rope":
            cos, sin = rope_tables(cfg.seq_len, cfg.d_model // cfg.n_heads, cfg.rope_theta)
            # Not persistent: derived from the config, and kept in FP32 whatever the module dtype.
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.takes_tokens = True
        """False on a pipeline stage after the first (parallel/pipeline/split.py): the input is
        the previous stage's hidden states, the embedding is elsewhere."""
        self.gives_logits = True
        """False on a pipeline stage before the last: the output is the hidden states."""
        self.hidden_seq_shards = 1
        """Parts of the sequence a stage's hidden-state input holds one of (tensor parallelism's
        sequence shards, set by its plan): the whole sequence is this many times longer."""
        self.context: SequenceChunks | None = None
        """Set by context parallelism (parallel/context/): forward takes whole sequences and
        keeps this rank's chunks of them, at their true positions; logits are the chunks'."""
        self.document_eos: int | None = None
        """Set from outside (data.document_mask): the EOS id that ends each document packed into
        a sequence. Attention then stays inside a document and positions restart at each one."""
        if init_seed is not None:
            self.reset_parameters(init_seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Draw every parameter from its own generator seeded by (seed, name): the values a
        sharded build draws one parameter at a time (model/init.py)."""
        for name, param in self.named_parameters():  # a tied weight is listed, and drawn, once
            if not param.is_meta:  # shapes only: nothing to draw
                param.copy_(initial_value(self, name, param.shape, param.device, seed))

    def _linear_scale(self, module: nn.Module) -> float:
        residual = getattr(module, "residual_scaled_init", False)
        return 1 / math.sqrt(2 * self.cfg.n_layers) if residual else 1.0

    def init_value(
        self, name: str, shape: torch.Size, device: torch.device, generator: torch.Generator
    ) -> torch.Tensor:
        """The initial value of parameter `name` (as named by named_parameters, or canonical),
        drawn from `generator`: normal(0, init_std) for matrices (embeddings, linear layers, the
        residual output projections scaled by 1/sqrt(2 n_layers)), ones for norm gains, zeros
        for biases."""
        owner_name, _, attr = name.rpartition(".")
        owner = self.get_submodule(owner_name)
        out = torch.empty(shape, dtype=torch.float32, device=device)
        if attr == "weight" and len(shape) >= 2:  # linear layers (also replaced ones), embeddings
            std = self.cfg.init_std * self._linear_scale(owner)
            return out.normal_(0.0, std, generator=generator)
        if attr in ("w_gate", "w_up", "w_down"):  # MoE experts, stacked (experts, in, out)
            residual = 1 / math.sqrt(2 * self.cfg.n_layers) if attr == "w_down" else 1.0
            return out.normal_(0.0, self.cfg.init_std * residual, generator=generator)
        if attr == "weight":  # LayerNorm, RMSNorm gains
            return out.fill_(1.0)
        return out.zero_()  # biases

    def init_buffers(self) -> None:
        """Recompute the non-persistent buffers (rotary tables) after `to_empty`, or after a
        build inside ZeRO-3's zero.Init (which casts every floating tensor created in it, arange
        included, to the compute dtype)."""
        if self.cfg.position == "rope":
            cos, sin = rope_tables(
                self.cfg.seq_len, self.cfg.d_model // self.cfg.n_heads, self.cfg.rope_theta
            )
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def _positions_and_mask(
        self, idx: torch.Tensor, seq: int, cache: KVCache | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if cache is not None:
            if self.document_eos is not None:
                # Positions and masks restart at each EOS; the cache keeps one causal stream.
                raise ValueError(
                    "a KV cache does not apply the document mask (data.document_mask): feed the "
                    "last document alone (generate.last_document) to a model without document_eos"
                )
            start = cache.length
            return torch.arange(start, start + seq, device=idx.device), cache.mask(seq, idx.device)
        if self.document_eos is None:
            return torch.arange(seq, device=idx.device), None
        if self.context is not None:  # document numbers: the ring makes each block's mask
            return document_ids(idx, self.document_eos)
        return document_positions(idx, self.document_eos)

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """Token ids (batch, seq) -> logits (batch, seq, vocab) in the compute dtype. With a
        `cache`, idx holds the tokens after the cached ones, which it then holds too. A pipeline
        stage (takes_tokens, gives_logits) takes or gives hidden states (batch, seq, d_model)
        instead, and runs its own blocks only."""
        seq = idx.shape[1] * (1 if self.takes_tokens else self.hidden_seq_shards)
        if self.context is not None and not self.takes_tokens:
            seq *= self.context.degree  # a later stage's hidden states: this rank's chunks
        start = cache.length if cache is not None else 0
        if start + seq > self.cfg.seq_len:
            raise ValueError(
                f"sequence of {start + seq} tokens is longer than model.seq_len={self.cfg.seq_len}"
            )
        positions, mask = self._positions_and_mask(idx, seq, cache)
        if self.context is not None:  # this rank's chunks, at their true positions
            positions = self.context.local(positions, dim=-1)
            if self.takes_tokens:
                idx = self.context.local(idx)
        x = self._embed(idx, positions) if self.takes_tokens else idx
        rope = None
        if self.cfg.position == "rope" and self.context is not None and positions.dim() == 1:
            rope = (self.rope_cos[positions], self.rope_sin[positions])
        elif self.cfg.position == "rope" and positions.dim() == 1:  # start, start + 1, ...
            rope = (self.rope_cos[start : start + seq], self.rope_sin[start : start + seq])
        elif self.cfg.position == "rope":  # per-token positions, broadcast over heads
            rope = (self.rope_cos[positions].unsqueeze(1), self.rope_sin[positions].unsqueeze(1))
        blocks = block_list(self.blocks)
        layers = cache.layers if cache is not None else [None] * len(blocks)
        for block, layer_cache in zip(blocks, layers, strict=True):
            x = block(x, rope, mask, cache=layer_cache)
        return self.lm_head(self.norm_f(x)) if self.gives_logits else x

    def _embed(self, idx: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx)
        if self.pos_emb is not None:
            x = x + self.pos_emb(positions)
        return self.drop(x)


class GradientRoles(NamedTuple):
    """What the suspicion tier (resilience/suspicion.py) must know of a model's gradient tensors."""

    inert: frozenset[str] = frozenset()
    """Those whose gradient is 0 in exact arithmetic, so that what a step computes for them is
    rounding noise: nothing the model computes depends on them."""
    unlike: frozenset[str] = frozenset()
    """Those whose rows are not alike, so that shards cut by rows need not move together: a
    router or stacked experts (rows are experts, whose loads differ)."""


def gradient_roles(names: list[str], cfg: ModelConfig) -> GradientRoles:
    """The roles of bigtrain's GPT's gradients (none for a Hugging Face model). The key bias of
    attention whose keys are not rotated is inert: a query's product with it is the same for
    every key, and softmax does not see a constant."""
    if cfg.kind != "gpt":
        return GradientRoles()
    inert = cfg.bias and cfg.position != "rope"
    return GradientRoles(
        frozenset(n for n in names if inert and n.endswith(".attn.k.bias")),
        frozenset(n for n in names if ".moe.router." in n or ".moe.experts." in n),
    )


def block_list(blocks: nn.ModuleList | nn.ModuleDict) -> list[nn.Module]:
    """The blocks in order: a whole model's ModuleList, or a pipeline stage's ModuleDict keyed
    by each block's index in the whole model (so parameter names stay the whole model's)."""
    return list(blocks.values()) if isinstance(blocks, nn.ModuleDict) else list(blocks)


class LayerCache:
    """One attention layer's keys and values so far, (batch, kv heads, positions, head dim)."""

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self.length = 0
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new tokens' keys and values; all of them so far (views of the buffers)."""
        end = self.length + k.shape[2]
        if self.keys is None or self.values is None:
            # Made at first use: on the device and in the dtype of the keys (the compute dtype).
            shape = (k.shape[0], k.shape[1], self.max_len, k.shape[3])
            self.keys, self.values = k.new_empty(shape), v.new_empty(shape)
        self.keys[:, :, self.length : end] = k
        self.values[:, :, self.length : end] = v
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]


class KVCache:
    """Every layer's keys and values of the tokens fed so far, for generation with the GPT:
    `GPT.forward(new_tokens, cache)` feeds the new tokens at positions `length`, `length + 1`,
    ...; they attend to the cached tokens and causally to each other. Learned and rotary
    positions alike; buffers of `max_len` positions (model.seq_len) are made at first use."""

    def __init__(self, num_layers: int, max_len: int) -> None:
        self.layers = [LayerCache(max_len) for _ in range(num_layers)]

    @property
    def length(self) -> int:
        """Tokens cached: the position of the next token fed."""
        return self.layers[0].length

    def mask(self, seq: int, device: torch.device) -> torch.Tensor | None:
        """(seq, length + seq) booleans, True where new token i may attend: every cached token
        and the new ones up to itself. None for a single new token, which attends to all."""
        if seq == 1:
            return None
        ones = torch.ones(seq, self.length + seq, dtype=torch.bool, device=device)
        return ones.tril(diagonal=self.length)


def document_ids(idx: torch.Tensor, eos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For sequences of documents each ended by `eos`: each token's position within its document
    and its document's number in the sequence (both (batch, seq))."""
    seq = idx.shape[1]
    ends = idx == eos
    doc = torch.cumsum(ends, dim=1) - ends.long()  # EOS belongs to the document it ends
    t = torch.arange(seq, device=idx.device).expand_as(idx)
    starts = torch.ones_like(ends)
    starts[:, 1:] = ends[:, :-1]
    first = torch.where(starts, t, torch.zeros_like(t)).cummax(dim=1).values
    return t - first, doc


def document_positions(idx: torch.Tensor, eos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For sequences of documents each ended by `eos`: each token's position within its document
    (batch, seq), and the attention mask (batch, 1, seq, seq), True where token i may attend to
    token j: j <= i in the same document."""
    positions, doc = document_ids(idx, eos)
    causal = torch.ones(idx.shape[1], idx.shape[1], dtype=torch.bool, device=idx.device).tril()
    mask = (doc.unsqueeze(2) == doc.unsqueeze(1)) & causal
    return positions, mask.unsqueeze(1)


def num_params(model: nn.Module, non_embedding: bool = False, active: bool = False) -> int:
    """Parameters counted once (tied weights once). non_embedding drops the token and position
    tables, the count that enters the 6N FLOPs rule; `active` counts of each MoE block's routed
    experts the top_k one token goes through."""
    total = sum(p.numel() for p in model.parameters())
    if active:
        total -= sum(r.params - r.active for r in routed_experts(model))
    if non_embedding:
        for name in ("tok_emb", "pos_emb"):
            table = getattr(model, name, None)
            if table is not None:
                total -= table.weight.numel()
        lm_head = getattr(model, "lm_head", None)
        tok_emb = getattr(model, "tok_emb", None)
        if lm_head is not None and tok_emb is not None and lm_head.weight is tok_emb.weight:
            total += lm_head.weight.numel()  # the tied table still does the output matmul
    return total


def flops_per_token(cfg: ModelConfig, n_params_non_embedding: int) -> float:
    """Training FLOPs per token (forward + backward): 6N for the weight matmuls plus
    12 * layers * d_model * seq_len for attention scores and values (PaLM appendix B, causal
    masking not discounted)."""
    return 6.0 * n_params_non_embedding + 12.0 * cfg.n_layers * cfg.d_model * cfg.seq_len
