"""Text generation: the sampling rule (temperature, top-k, top-p) and the decoding loop.

`decode` asks a `Step` for the logits after the tokens fed so far and picks the next token, one at
a time, until the tokenizer's EOS, `max_new_tokens`, or the model's last position. Two kinds of
step: `cached_step` feeds bigtrain's GPT only the new token, keeping the keys and values of the
earlier ones in a `KVCache` (one position per token); `recompute_step` runs any logits function
over the whole sequence each time (the training backends' `eval_logits`, for samples during
training: callbacks/samples.py). Both give the same tokens and logits (tests/model/
test_generate.py). transformers models decode with their own `generate` (`generate_hf`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bigtrain.model.gpt import GPT, KVCache
from bigtrain.model.hf import HFCausalLM

Step = Callable[[torch.Tensor], torch.Tensor]
"""The new tokens (1, n) -> the logits (1, vocab) that follow the whole sequence fed so far."""


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int = 64
    """Tokens generated at most."""
    temperature: float = 1.0
    """Logits are divided by it before sampling; 0: greedy (always the most likely token)."""
    top_k: int = 0
    """Sample among the k most likely tokens only; 0: all."""
    top_p: float = 1.0
    """Nucleus sampling: among the fewest most likely tokens whose probabilities reach top_p;
    1: all."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens got {self.max_new_tokens}, expected >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature got {self.temperature}, expected >= 0")
        if self.top_k < 0:
            raise ValueError(f"top_k got {self.top_k}, expected >= 0 (0: off)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p got {self.top_p}, expected 0 < top_p <= 1")


@dataclass
class Generation:
    tokens: list[int]
    """The new tokens: the prompt not included, nor the EOS that ended them."""
    stop: str
    """Why it ended: `eos`, `max_new_tokens`, or `context` (the model's positions are full)."""


@dataclass
class Sample:
    """A prompt's generation as text: what `bigtrain generate --json` prints per prompt and what
    RUN_DIR/samples.jsonl holds (with the step)."""

    prompt: str
    text: str
    """The continuation of the prompt (decoded with the prompt, so that no character that
    straddles the boundary is cut)."""
    tokens: list[int]
    stop: str

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def filter_logits(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """FP32 logits (..., vocab) divided by the temperature, with -inf where top-k and then
    top-p rule a token out (the order of transformers' warpers). Temperature must be > 0."""
    logits = logits.float() / sampling.temperature
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        ordered, order = logits.sort(dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        # Out: a token when the more likely ones already hold top_p (the first always stays).
        out_sorted = probs.cumsum(dim=-1) - probs >= sampling.top_p
        out = torch.zeros_like(out_sorted).scatter(-1, order, out_sorted)
        logits = logits.masked_fill(out, float("-inf"))
    return logits


def next_token(
    logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None
) -> torch.Tensor:
    """The next token of each row of logits (batch, vocab): the argmax at temperature 0, else
    drawn from the filtered distribution with `generator` (on the logits' device)."""
    if sampling.temperature == 0:
        return logits.argmax(dim=-1)
    probs = filter_logits(logits, sampling).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def cached_step(model: GPT) -> Step:
    """Feeds the GPT only the new tokens; the earlier ones' keys and values stay in a KVCache."""
    cache = KVCache(model.cfg.n_layers, model.cfg.seq_len)
    return lambda new: model(new, cache)[:, -1]


def recompute_step(logits_of: Callable[[torch.Tensor], torch.Tensor]) -> Step:
    """Runs `logits_of` (ids (1, seq) -> logits (1, seq, vocab)) over the whole sequence so far."""
    fed: list[torch.Tensor] = []

    def step(new: torch.Tensor) -> torch.Tensor:
        fed.append(new)
        return logits_of(torch.cat(fed, dim=1))[:, -1]

    return step


@torch.no_grad()
def decode(
    step: Step,
    prompt: torch.Tensor,
    sampling: Sampling,
    eos_id: int | None,
    max_len: int,
    generator: torch.Generator | None = None,
    agree: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Generation:
    """Generate after `prompt` (1, n) token ids, n <= max_len (the model's positions).
    `agree(token)`: the token every rank goes on with (rank 0's, when ranks decode together)."""
    assert 0 < prompt.shape[1] <= max_len, f"a prompt of {prompt.shape[1]} tokens, {max_len} fit"
    logits = step(prompt)
    tokens: list[int] = []
    while True:
        token = next_token(logits, sampling, generator)
        if agree is not None:
            token = agree(token)
        value = int(token.item())  # expensive device-to-host synchronization: the EOS check
        if value == eos_id:
            return Generation(tokens, "eos")
        tokens.append(value)
        if len(tokens) == sampling.max_new_tokens:
            return Generation(tokens, "max_new_tokens")
        if prompt.shape[1] + len(tokens) > max_len:  # no position left to feed the token at
            return Generation(tokens, "context")
        logits = step(token.view(1, 1))


@torch.no_grad()
def generate_hf(
    model: HFCausalLM,
    prompt: torch.Tensor,
    sampling: Sampling,
    eos_id: int | None,
    max_len: int,
    seed: int = 0,
) -> Generation:
    """transformers' own `generate` (its KV cache, its sampling warpers) with the same settings;
    sampling draws from torch's global generator, seeded with `seed` inside a forked RNG."""
    room = max_len + 1 - prompt.shape[1]  # as decode: the last position predicts one more
    options: dict = {"do_sample": sampling.temperature > 0, "eos_token_id": eos_id}
    if sampling.temperature > 0:  # explicit, over any defaults of the model's generation config
        top_k = sampling.top_k
        options.update(temperature=sampling.temperature, top_k=top_k, top_p=sampling.top_p)
    devices = [prompt.device] if prompt.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        out = model.hf.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=min(sampling.max_new_tokens, room),
            pad_token_id=eos_id,
            **options,
        )
    tokens = out[0, prompt.shape[1] :].tolist()
    if tokens and tokens[-1] == eos_id:
        return Generation(tokens[:-1], "eos")
    if len(tokens) < sampling.max_new_tokens:
        return Generation(tokens, "context")
    return Generation(tokens, "max_new_tokens")


def last_document(ids: list[int], eos_id: int) -> list[int]:
    """The tokens that the last one attends to in a model trained with data.document_mask: those
    of its own document, which starts after the previous EOS (an EOS ends its document)."""
    for i in range(len(ids) - 2, -1, -1):
        if ids[i] == eos_id:
            return ids[i + 1 :]
    return ids


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """The prompt's token ids as training encoded text (no special tokens added); an empty
    prompt is the tokenizer's EOS alone: the start of a new document."""
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    return ids or [tokenizer.eos_token_id]


def as_sample(tokenizer, prompt: str, prompt_ids: list[int], generation: Generation) -> Sample:
    """The generation as text, decoded together with the prompt's tokens."""
    before = tokenizer.decode(prompt_ids)
    text = tokenizer.decode(prompt_ids + generation.tokens)[len(before) :]
    return Sample(prompt, text, generation.tokens, generation.stop)
