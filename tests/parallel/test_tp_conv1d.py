"""bigtrain's tensor-parallel Conv1D on 2 gloo ranks: a transformers GPT-2 block split by the
GPT-2 plan computes what the whole block computes, the fused q/k/v layer each rank's heads, and
every gradient lands as a DTensor with its parameter's placements."""

from __future__ import annotations

import pytest

from tests.distributed import run_distributed

pytestmark = pytest.mark.distributed

PLAN = {
    "attn.c_attn": "colwise_qkv",
    "attn.c_proj": "rowwise",
    "mlp.c_fc": "colwise",
    "mlp.c_proj": "rowwise",
}
D, HEADS = 16, 4


def split_block() -> dict:
    import copy

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    from bigtrain.parallel.tensor.conv1d import parallelize_conv1d, qkv_columns

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    rank = mesh.get_local_rank()
    torch.manual_seed(0)  # the same block and input on both ranks
    config = GPT2Config(n_embd=D, n_head=HEADS, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
    whole = GPT2Block(config, layer_idx=0)
    x = torch.randn(2, 5, D)
    split = copy.deepcopy(whole)
    for name, style in PLAN.items():
        parallelize_conv1d(split, name, style, mesh)

    out = {"split_size": split.attn.split_size}
    h = whole.ln_1(x)  # the fused layer alone: this rank's columns of q, k and v
    out["qkv"] = (split.attn.c_attn(h) - qkv_columns(whole.attn.c_attn(h), rank, 2)).abs().max()

    x_whole, x_split = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_whole, y_split = whole(x_whole)[0], split(x_split)[0]
    (y_whole**2).sum().backward()
    (y_split**2).sum().backward()
    out["output"] = (y_split - y_whole).abs().max()
    out["input_grad"] = (x_split.grad - x_whole.grad).abs().max()
    reference = dict(whole.named_parameters())
    out["grads"] = {}
    for name, param in split.named_parameters():
        grad = param.grad
        if isinstance(param, DTensor):
            assert isinstance(grad, DTensor) and grad.placements == param.placements, name
            grad = grad.full_tensor()
        out["grads"][name] = (grad - reference[name].grad).abs().max()
    out["placements"] = {
        name: [repr(p) for p in split.get_submodule(name).weight.placements] for name in PLAN
    }
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(split_block, 2)


def test_fused_qkv_computes_each_ranks_heads_of_q_k_and_v(ranks):
    for r in ranks:
        assert r["split_size"] == D // 2
        assert r["qkv"] == 0


def test_split_block_matches_the_whole_block_with_its_gradients(ranks):
    for r in ranks:
        assert r["output"] < 1e-6 and r["input_grad"] < 1e-6
        assert len(r["grads"]) == 12  # 2 LayerNorms, 4 Conv1D, each weight and bias
        for name, diff in r["grads"].items():
            assert diff < 1e-6, name


def test_placements_follow_the_style(ranks):
    assert ranks[0]["placements"] == {
        "attn.c_attn": ["Replicate()"],
        "attn.c_proj": ["Shard(dim=0)"],
        "mlp.c_fc": ["Shard(dim=1)"],
        "mlp.c_proj": ["Shard(dim=0)"],
    }
