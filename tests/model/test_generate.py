"""Generation: the GPT's KV cache against recomputing the whole prefix, the sampling filters
against transformers' warpers, seeds, EOS and the end of the context."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bigtrain.config.model import MoEConfig
from bigtrain.config.schema import ModelConfig
from bigtrain.model.generate import (
    Sampling,
    cached_step,
    decode,
    filter_logits,
    generate_hf,
    last_document,
    next_token,
    recompute_step,
)
from bigtrain.model.gpt import GPT, KVCache
from bigtrain.model.hf import build_hf

pytestmark = pytest.mark.unit

# init_std 0.3: logits far apart, so that no greedy choice hangs on a rounding difference
LEARNED = ModelConfig(
    n_layers=2, n_heads=4, d_model=32, seq_len=16, vocab_size=60, init_std=0.3, bias=True
)
ROPE_GQA = dataclasses.replace(
    LEARNED, position="rope", norm="rmsnorm", mlp="swiglu", bias=False, n_kv_heads=2
)
# An MoE model with a capacity: generation is dropless (capacity applies to training only), so
# routing each new token alone gives what routing the whole prefix gives.
MOE = dataclasses.replace(ROPE_GQA, moe=MoEConfig(experts=4, top_k=2, capacity_factor=0.5))
MODELS = [(LEARNED, False), (ROPE_GQA, False), (ROPE_GQA, True), (MOE, False)]
IDS = ["learned", "rope-gqa", "rope-gqa-fp32-softmax", "moe"]


def _model(cfg: ModelConfig, fp32_softmax: bool) -> GPT:
    model = GPT(cfg, init_seed=3).eval()
    for block in model.blocks:
        block.attn.fp32_softmax = fp32_softmax
    return model


def _recording(step):
    """The step, and the list of the logits it returns."""
    seen: list[torch.Tensor] = []

    def wrapped(new: torch.Tensor) -> torch.Tensor:
        seen.append(step(new))
        return seen[-1]

    return wrapped, seen


@pytest.mark.parametrize(("cfg", "fp32_softmax"), MODELS, ids=IDS)
def test_kv_cache_gives_the_tokens_and_logits_of_the_whole_prefix(cfg, fp32_softmax):
    model = _model(cfg, fp32_softmax)
    prompt = torch.tensor([[5, 17, 3, 42, 8]])
    greedy = Sampling(max_new_tokens=40, temperature=0.0)  # more than the 16 positions hold
    cached, cached_logits = _recording(cached_step(model))
    full, full_logits = _recording(recompute_step(model))
    a = decode(cached, prompt, greedy, eos_id=None, max_len=cfg.seq_len)
    b = decode(full, prompt, greedy, eos_id=None, max_len=cfg.seq_len)
    assert a.tokens == b.tokens and a.stop == b.stop == "context"
    assert len(a.tokens) == cfg.seq_len + 1 - prompt.shape[1]  # the last position predicts one
    assert len(set(a.tokens)) > 2  # not one token over and over: the check has teeth
    assert len(cached_logits) == len(full_logits) == len(a.tokens)
    for ours, whole in zip(cached_logits, full_logits, strict=True):
        assert ours.dtype == torch.float32
        torch.testing.assert_close(ours, whole, rtol=0, atol=1e-5)


@pytest.mark.parametrize(("cfg", "fp32_softmax"), MODELS, ids=IDS)
def test_a_cache_fed_in_chunks_gives_the_logits_of_one_forward(cfg, fp32_softmax):
    model = _model(cfg, fp32_softmax)
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    cache = KVCache(cfg.n_layers, cfg.seq_len)
    with torch.no_grad():
        whole = model(ids)
        parts = [model(ids[:, :5], cache), model(ids[:, 5:6], cache), model(ids[:, 6:], cache)]
    assert cache.length == 12
    torch.testing.assert_close(torch.cat(parts, dim=1), whole, rtol=0, atol=1e-5)


def test_a_cache_refuses_the_document_mask_and_positions_past_the_table():
    model = _model(LEARNED, False)
    model.document_eos = 0
    with pytest.raises(ValueError, match="document mask"):
        model(torch.tensor([[1, 2]]), KVCache(2, 16))
    model.document_eos = None
    cache = KVCache(2, 16)
    with torch.no_grad():
        model(torch.zeros(1, 15, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="17 tokens is longer than model.seq_len=16"):
        model(torch.zeros(1, 2, dtype=torch.long), cache)


def test_last_document_starts_after_the_eos_before_the_last_token():
    assert last_document([4, 5, 0, 6, 7], eos_id=0) == [6, 7]
    assert last_document([4, 0, 5, 0], eos_id=0) == [5, 0]  # an EOS belongs to what it ends
    assert last_document([4, 5], eos_id=0) == [4, 5]


def test_top_k_and_top_p_keep_the_tokens_they_should():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    logits = probs.log()
    kept = lambda s: filter_logits(logits, s).isfinite()[0].tolist()  # noqa: E731
    assert kept(Sampling(top_k=2)) == [False, True, False, True]
    assert kept(Sampling(top_p=0.8)) == [False, True, False, True]  # 0.5 + 0.3 reach 0.8
    assert kept(Sampling(top_p=0.81)) == [False, True, True, True]
    assert kept(Sampling(top_p=0.01)) == [False, True, False, False]  # the first always stays
    assert kept(Sampling(top_k=3, top_p=0.6)) == [False, True, False, True]
    halved = filter_logits(torch.tensor([[2.0, -4.0]]), Sampling(temperature=2.0))
    assert halved.tolist() == [[1.0, -2.0]]


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(0.7, 5, 1.0), (1.3, 0, 0.9)])
def test_filters_match_transformers_warpers(temperature, top_k, top_p):
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1)) * 3
    theirs = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        theirs = TopKLogitsWarper(top_k)(None, theirs)
    theirs = TopPLogitsWarper(top_p)(None, theirs) if top_p < 1 else theirs
    ours = filter_logits(logits, Sampling(temperature=temperature, top_k=top_k, top_p=top_p))
    assert torch.equal(ours.isfinite(), theirs.isfinite())
    assert 1 < int(ours.isfinite().sum(dim=-1).min()) < 50  # each row kept some, not all
    torch.testing.assert_close(ours[ours.isfinite()], theirs[theirs.isfinite()])


def test_sampling_follows_the_filtered_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]]).expand(4000, 4)
    draws = next_token(logits, Sampling(top_k=2), torch.Generator().manual_seed(0))
    counts = torch.bincount(draws, minlength=4).tolist()
    assert counts[0] == counts[1] == 0  # outside the top 2
    share = counts[3] / 4000  # e^3 / (e^2 + e^3) = 0.731
    assert abs(share - 0.731) < 0.03


def test_a_seed_repeats_a_sampled_generation_and_another_seed_changes_it():
    model = _model(ROPE_GQA, False)
    prompt = torch.tensor([[1, 2, 3]])
    sampling = Sampling(max_new_tokens=12, temperature=1.5)

    def run(seed: int) -> list[int]:
        generator = torch.Generator().manual_seed(seed)
        return decode(cached_step(model), prompt, sampling, None, 16, generator).tokens

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_decoding_stops_at_eos_and_at_max_new_tokens():
    eos, script = 9, [4, 5, 6, 9, 7]  # the step makes each next token the most likely in turn
    fed: list[int] = []

    def step(new: torch.Tensor) -> torch.Tensor:
        fed.extend(new[0].tolist())
        logits = torch.zeros(1, 10)
        logits[0, script[len(fed) - 3]] = 1.0  # after the 3 prompt tokens: script[0], ...
        return logits

    prompt = torch.tensor([[1, 2, 3]])
    out = decode(step, prompt, Sampling(max_new_tokens=10, temperature=0), eos, 16)
    assert out.tokens == [4, 5, 6] and out.stop == "eos"
    assert fed == [1, 2, 3, 4, 5, 6]  # the EOS is never fed
    fed.clear()
    out = decode(step, prompt, Sampling(max_new_tokens=2, temperature=0), eos, 16)
    assert out.tokens == [4, 5] and out.stop == "max_new_tokens"


def test_generate_hf_matches_greedy_decoding_of_its_logits():
    model = build_hf({"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2}, None, 60)
    model.eval()
    prompt = torch.tensor([[5, 6, 7]])
    greedy = Sampling(max_new_tokens=8, temperature=0)
    theirs = generate_hf(model, prompt, greedy, eos_id=None, max_len=64)
    ours = decode(recompute_step(model), prompt, greedy, None, 64)
    assert theirs.tokens == ours.tokens and len(ours.tokens) == 8
    assert theirs.stop == "max_new_tokens"
