"""Sources read any slice of any parameter: what ZeRO fragments (ranges that start mid-row) and
FSDP2 shards (blocks of rows) ask of a Hugging Face directory, and what `ckpt convert` asks of
the checkpoints of earlier versions (checkpoint/legacy.py)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from bigtrain.checkpoint.legacy import LocalSource, legacy_source
from bigtrain.checkpoint.sources import HFSource
from bigtrain.errors import ConfigError
from tests.checkpoint.test_export import CONFIGS, export_gpt

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("name", ["gpt2-untied-bias", "llama-gqa-untied", "mixtral-untied"])
def test_hf_source_reads_any_range_and_block_of_every_parameter(tmp_path, name):
    _, params, mapping, _ = export_gpt(CONFIGS[name], tmp_path / "hf", max_shard_bytes=20_000)
    source = HFSource(tmp_path / "hf", mapping.parts)
    source.check_covers({n: tuple(p.shape) for n, p in params.items()})
    generator = torch.Generator().manual_seed(0)
    for pname, p in params.items():
        flat = p.detach().reshape(-1)
        assert torch.equal(source.full(pname), p.detach()), pname
        for _ in range(3):  # ranges that start and end mid-row, as ZeRO fragments do
            start = int(torch.randint(0, flat.numel(), (), generator=generator))
            stop = int(torch.randint(start + 1, flat.numel() + 1, (), generator=generator))
            assert torch.equal(source.read(pname, "param", start, stop), flat[start:stop]), pname
        if p.dim() == 2 and p.shape[0] >= 4:  # an FSDP2-like shard: rows 1..3, columns 2..
            block = source.block(pname, "param", (1, 2), (2, p.shape[1] - 2))
            assert torch.equal(block, p.detach()[1:3, 2:]), pname


def test_a_source_that_does_not_fit_names_the_tensors(tmp_path):
    _, params, mapping, _ = export_gpt(CONFIGS["llama-gqa-untied"], tmp_path / "hf")
    source = HFSource(tmp_path / "hf", mapping.parts)
    shapes = {n: tuple(p.shape) for n, p in params.items()}
    shapes["blocks.9.attn.q.weight"] = (32, 32)
    shapes["tok_emb.weight"] = (100, 32)
    with pytest.raises(
        ConfigError,
        match=r"missing \['blocks.9.attn.q.weight'\].*tok_emb.weight \[96, 32\] there, \[100, 32\]",
    ):
        source.check_covers(shapes)


def test_local_source_reads_slices_and_steps(tmp_path):
    weight = torch.arange(24.0).view(6, 4)
    scalar = torch.tensor(3.0)
    save_file({"w": weight, "s": scalar}, str(tmp_path / "model.safetensors"))
    moments = {"w.exp_avg": weight * 2, "w.exp_avg_sq": weight * 3}
    meta = {"steps": json.dumps({"w": 7.0})}
    save_file(moments, str(tmp_path / "optimizer.safetensors"), metadata=meta)
    source = LocalSource(tmp_path)
    assert source.shapes == {"w": (6, 4), "s": ()}
    assert torch.equal(source.read("w", "param", 5, 14), weight.reshape(-1)[5:14])
    assert torch.equal(source.read("w", "exp_avg_sq", 3, 9), (weight * 3).reshape(-1)[3:9])
    assert source.step("w") == 7.0 and source.step("s") == 0.0
    assert torch.equal(source.read("s", "exp_avg", 0, 1), torch.zeros(1))  # no state: zeros
    assert source.buffer("s").item() == 3.0 and source.buffer("nothing") is None


def test_hub_names_without_the_base_prefix_and_empty_shards(tmp_path):
    from safetensors.torch import load_file

    _, params, mapping, _ = export_gpt(CONFIGS["gpt2-untied-bias"], tmp_path / "hf")
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    # the hub's gpt2 stores `wte.weight`, `h.0.*`: transformers adds `transformer.` on load
    bare = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    (tmp_path / "hf" / "model.safetensors").unlink()
    save_file(bare, str(tmp_path / "hf" / "model.safetensors"))
    source = HFSource(tmp_path / "hf", mapping.parts)
    source.check_covers({n: tuple(p.shape) for n, p in params.items()})
    for name, p in params.items():
        assert torch.equal(source.full(name), p.detach()), name
    assert source.read("tok_emb.weight", "param", 64, 64).numel() == 0  # a rank without rows


def test_a_damaged_hf_directory_is_named(tmp_path):
    _, _, mapping, _ = export_gpt(
        CONFIGS["llama-gqa-untied"], tmp_path / "hf", max_shard_bytes=20_000
    )
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    missing = sorted(set(index["weight_map"].values()))[0]
    (tmp_path / "hf" / missing).unlink()
    with pytest.raises(ConfigError, match=f"cannot read '{missing}'"):
        HFSource(tmp_path / "hf", mapping.parts)
    (tmp_path / "hf" / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(ConfigError, match="not a safetensors index"):
        HFSource(tmp_path / "hf", mapping.parts)


def test_a_local_checkpoint_of_the_old_layout_is_refused(tmp_path):
    save_file({"w": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "optimizer.pt").write_bytes(b"old")
    with pytest.raises(ConfigError, match="holds optimizer.pt.*would be lost"):
        LocalSource(tmp_path)


def test_init_from_refuses_a_hf_config_that_computes_otherwise(tmp_path):
    import dataclasses

    from bigtrain.model.hf_check import check_hf_config
    from bigtrain.model.hf_mapping import mapping_for

    cfg = CONFIGS["llama-gqa-untied"]
    _, params, mapping, _ = export_gpt(cfg, tmp_path / "hf")
    found = json.loads((tmp_path / "hf" / "config.json").read_text())
    check_hf_config(mapping, found, "dir")  # its own export passes
    shapes = {n: tuple(p.shape) for n, p in params.items()}
    other = mapping_for(dataclasses.replace(cfg, rope_theta=500000.0, norm_eps=1e-6), shapes)
    with pytest.raises(
        ConfigError,
        match=r"rms_norm_eps 1e-05 there, 1e-06 here .*rope \(10000.0, 'default'\) there, \(500000.0",
    ):
        check_hf_config(other, found, "dir")
    tied = dict(found, tie_word_embeddings=True)
    with pytest.raises(
        ConfigError, match=r"tie_word_embeddings True there, False here \(model.tie_embeddings\)"
    ):
        check_hf_config(mapping, tied, "dir")


@pytest.mark.filterwarnings("ignore::UserWarning")  # DCP without a process group says so
def test_a_fused_fsdp_checkpoint_reads_under_todays_names(tmp_path):
    """An `fsdp` (DCP) checkpoint of before the q/k/v split: the wrapper maps each read to the
    fused tensor's rows, moments and step counts included (as for `local`, tests/checkpoint/test_manager.py)."""
    import torch.distributed.checkpoint as dcp

    from bigtrain.checkpoint.legacy import UnfusedSource

    qkv, up = torch.arange(64 * 32.0).view(64, 32), torch.randn(96, 32)  # GQA: k, v of 16 rows
    state = {
        "model.blocks.0.attn.qkv.weight": qkv,
        "optim.state.blocks.0.attn.qkv.weight.exp_avg": qkv * 2,
        "optim.state.blocks.0.attn.qkv.weight.step": torch.tensor(5.0),
        "model.blocks.0.mlp.up.weight": up,  # SwiGLU: [gate; up], twice down's input width
        "model.blocks.0.mlp.down.weight": torch.zeros(32, 48),
    }
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    source = legacy_source(tmp_path, "fsdp")
    assert isinstance(source, UnfusedSource)
    assert source.shapes["blocks.0.attn.k.weight"] == (16, 32)
    assert torch.equal(source.full("blocks.0.attn.v.weight"), qkv[48:])
    assert torch.equal(source.full("blocks.0.attn.k.weight", "exp_avg"), 2 * qkv[32:48])
    assert torch.equal(
        source.read("blocks.0.attn.k.weight", "param", 5, 40), qkv[32:48].reshape(-1)[5:40]
    )
    assert (
        source.step("blocks.0.attn.q.weight") == 5.0 and source.step("blocks.0.mlp.up.weight") == 0
    )
    assert torch.equal(source.full("blocks.0.mlp.gate.weight"), up[:48])
    assert torch.equal(source.full("blocks.0.mlp.up.weight"), up[48:])


def test_reading_a_dcp_checkpoint_without_a_process_group_warns_nothing(tmp_path):
    """DCP warns on every load without a process group ("assuming the intent is to load in a
    single process"), which is what the readers ask for (no_dist=True): nothing to tell a user."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from bigtrain.checkpoint.state import CheckpointReader

    weight = torch.randn(8, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the save's own warning is not under test
        dcp.save(
            {"model.tok_emb.weight": weight}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True
        )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        source = legacy_source(tmp_path, "fsdp")  # an fsdp checkpoint of format 1
        assert torch.equal(source.full("tok_emb.weight"), weight)
        assert torch.equal(CheckpointReader(tmp_path).full("tok_emb.weight"), weight)  # today's
    assert [str(w.message) for w in caught] == []
