import dataclasses

import pytest
import torch
from torch import nn

from bigtrain.config.schema import ModelConfig
from bigtrain.model import build_model, flops_per_token, num_params
from bigtrain.model.gpt import GPT, CausalSelfAttention

pytestmark = pytest.mark.unit

GPT2 = ModelConfig(n_layers=2, n_heads=4, d_model=64, seq_len=16, vocab_size=100)
LLAMA = dataclasses.replace(
    GPT2, position="rope", norm="rmsnorm", mlp="swiglu", bias=False, tie_embeddings=False
)


@pytest.mark.parametrize("cfg", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_output_shape_and_fp32_weights(cfg):
    torch.manual_seed(0)
    model = build_model(cfg, vocab_size=100)
    logits = model(torch.randint(0, 100, (3, 16)))
    assert logits.shape == (3, 16, 100)
    assert logits.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_architecture_options_take_effect():
    gpt2, llama = GPT(GPT2), GPT(LLAMA)
    assert gpt2.lm_head.weight is gpt2.tok_emb.weight
    assert llama.lm_head.weight is not llama.tok_emb.weight
    assert gpt2.pos_emb is not None and llama.pos_emb is None
    assert type(gpt2.norm_f).__name__ == "LayerNorm" and type(llama.norm_f).__name__ == "RMSNorm"
    # SwiGLU: 8/3 * 64 rounded up to 64, in a gate and an up layer; GELU: one up layer, 4 x 64
    assert llama.blocks[0].mlp.up.out_features == llama.blocks[0].mlp.gate.out_features == 192
    assert gpt2.blocks[0].mlp.up.out_features == 256 and gpt2.blocks[0].mlp.gate is None
    assert llama.blocks[0].attn.q.bias is None and gpt2.blocks[0].attn.q.bias is not None


def test_causal_future_tokens_do_not_change_past_logits():
    torch.manual_seed(0)
    model = GPT(LLAMA).eval()
    idx = torch.randint(0, 100, (1, 16))
    changed = idx.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 100
    torch.testing.assert_close(model(idx)[0, :10], model(changed)[0, :10])


def test_master_weights_fp32_while_matmuls_run_bf16():
    torch.manual_seed(0)
    model = GPT(GPT2)
    seen = []

    def hook(module, inputs, output):
        seen.append((module.weight.dtype, output.dtype))

    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.register_forward_hook(hook)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(torch.randint(0, 100, (2, 16)))
    assert len(seen) == 2 * 6 + 1  # q, k, v, proj, up, down per block + lm_head
    assert {w for w, _ in seen} == {torch.float32}
    assert {o for _, o in seen} == {torch.bfloat16}
    assert logits.dtype == torch.bfloat16


def test_norms_compute_in_fp32_under_bf16_autocast():
    model = GPT(LLAMA)
    captured = {}
    orig = torch.rsqrt

    def spy(x):
        captured.setdefault("dtype", x.dtype)
        return orig(x)

    torch.rsqrt = spy
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(torch.randint(0, 100, (1, 8)))
    finally:
        torch.rsqrt = orig
    assert captured["dtype"] == torch.float32


def test_fp32_softmax_path_matches_sdpa_and_runs_fp32():
    torch.manual_seed(0)
    attn = CausalSelfAttention(GPT2)
    x = torch.randn(2, 16, 64)
    reference = attn(x, None)
    attn.fp32_softmax = True
    torch.testing.assert_close(attn(x, None), reference, atol=1e-5, rtol=1e-5)

    dtypes = []
    orig = torch.Tensor.softmax

    def spy(self, *args, **kwargs):
        dtypes.append(self.dtype)
        return orig(self, *args, **kwargs)

    torch.Tensor.softmax = spy
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = attn(x, None)
    finally:
        torch.Tensor.softmax = orig
    assert dtypes == [torch.float32]
    assert out.dtype == torch.bfloat16


def test_flops_per_token_by_hand():
    cfg = dataclasses.replace(GPT2, vocab_size=100)
    model = GPT(cfg)
    n = num_params(model, non_embedding=True)
    # non-embedding = all - tok_emb - pos_emb + tied lm_head (it still multiplies)
    assert n == num_params(model) - 16 * 64
    assert flops_per_token(cfg, n) == 6 * n + 12 * 2 * 64 * 16


def test_too_long_sequence_is_refused():
    with pytest.raises(ValueError, match="longer than model.seq_len=16"):
        GPT(GPT2)(torch.zeros(1, 17, dtype=torch.long))


def test_grouped_query_attention_matches_its_explicit_path_and_shrinks_kv():
    from bigtrain.config.schema import ModelConfig
    from bigtrain.model.gpt import GPT

    torch.manual_seed(0)
    cfg = ModelConfig(n_layers=1, n_heads=4, n_kv_heads=2, d_model=64, seq_len=16, vocab_size=50)
    model = GPT(cfg)
    attn = model.blocks[0].attn
    assert attn.q.weight.shape == (64, 64) and attn.k.weight.shape == attn.v.weight.shape == (
        32,
        64,
    )
    ids = torch.randint(0, 50, (2, 16))
    fused = model(ids)
    model.blocks[0].attn.fp32_softmax = True  # explicit path: K/V heads repeated by hand
    torch.testing.assert_close(model(ids), fused, rtol=1e-5, atol=1e-5)


@pytest.mark.unit
@pytest.mark.parametrize("position", ["learned", "rope"])
@pytest.mark.parametrize("fp32_softmax", [False, True])
def test_document_mask_keeps_attention_and_positions_inside_each_document(position, fp32_softmax):
    from bigtrain.config.schema import ModelConfig
    from bigtrain.model.gpt import GPT

    eos = 0
    cfg = ModelConfig(
        n_layers=2, n_heads=2, d_model=32, seq_len=16, vocab_size=50, position=position
    )
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    for block in model.blocks:
        block.attn.fp32_softmax = fp32_softmax
    first = torch.tensor([[5, 6, 7, eos]])
    second = torch.tensor([[8, 9, 10, 11, 12]])
    both = torch.cat([first, second], dim=1)
    with torch.no_grad():
        plain = model(both)
        model.document_eos = eos
        masked = model(both)
        alone = model(second)
    # the second document sees nothing of the first, and starts at position 0
    torch.testing.assert_close(masked[:, 4:], alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(masked[:, :4], plain[:, :4])  # the first document is unchanged
    assert (masked[:, 4:] - plain[:, 4:]).abs().max() > 1e-3  # without the mask it differs
