import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from bigtrain.checkpoint.hf_export import check_export, export_hf, plan_shards
from bigtrain.config.model import MoEConfig
from bigtrain.config.schema import ModelConfig
from bigtrain.data.prepare.cache import train_bpe
from bigtrain.errors import ConfigError
from bigtrain.model import build_model
from bigtrain.model.gpt import GPT
from bigtrain.model.hf_mapping import Part, mapping_for, mapping_for_hf
from bigtrain.utils.names import canonical_name

pytestmark = pytest.mark.unit

VOCAB = 96
GPT2 = ModelConfig(n_layers=2, n_heads=4, d_model=32, seq_len=16, vocab_size=VOCAB)
LLAMA = dataclasses.replace(
    GPT2, position="rope", norm="rmsnorm", mlp="swiglu", bias=False, n_kv_heads=2
)
CONFIGS = {
    "gpt2-tied-bias": GPT2,
    "gpt2-untied-bias": dataclasses.replace(GPT2, tie_embeddings=False),
    "gpt2-tied-nobias": dataclasses.replace(GPT2, bias=False),
    "gpt2-untied-nobias": dataclasses.replace(GPT2, bias=False, tie_embeddings=False),
    "llama-gqa-tied": LLAMA,
    "llama-gqa-untied": dataclasses.replace(LLAMA, tie_embeddings=False),
    "llama-gqa-untied-bias": dataclasses.replace(LLAMA, tie_embeddings=False, bias=True),
    "mixtral-untied": dataclasses.replace(
        LLAMA, tie_embeddings=False, moe=MoEConfig(experts=4, top_k=2, d_expert=24)
    ),
}


def trained_like(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Canonical name -> parameter, every one moved off its init (biases off zero, gains off one),
    so a bias or gain exported to the wrong place changes the logits."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return {canonical_name(n): p for n, p in model.named_parameters()}


def export_gpt(cfg: ModelConfig, out_dir: Path, **kwargs):
    torch.manual_seed(0)
    model = GPT(cfg)
    params = trained_like(model)
    mapping = mapping_for(cfg, {n: tuple(p.shape) for n, p in params.items()})
    files = export_hf(
        mapping, params.__getitem__, out_dir, kwargs.pop("tokenizer_dir", None), **kwargs
    )
    return model, params, mapping, files


def written_tensors(out_dir: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for f in sorted(out_dir.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors


@pytest.mark.parametrize("cfg", CONFIGS.values(), ids=CONFIGS.keys())
def test_gpt_export_loads_in_transformers_with_the_same_logits(tmp_path, cfg):
    model, _, mapping, files = export_gpt(cfg, tmp_path / "out")
    assert files == ["config.json", "generation_config.json", "model.safetensors"]
    result = check_export(model, tmp_path / "out", VOCAB, cfg.seq_len)
    assert result["max_rel_diff"] <= 1e-4, result
    assert result["ok"] and result["missing_keys"] == [] and result["unexpected_keys"] == []
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == [mapping.architecture]
    llama = "MixtralForCausalLM" if cfg.moe.experts else "LlamaForCausalLM"
    assert mapping.architecture == (llama if cfg.mlp == "swiglu" else "GPT2LMHeadModel")
    assert config["tie_word_embeddings"] is cfg.tie_embeddings
    # a tied table is written once, as save_pretrained does
    assert ("lm_head.weight" in written_tensors(tmp_path / "out")) is not cfg.tie_embeddings


@pytest.mark.parametrize("name", ["gpt2-untied-nobias", "llama-gqa-untied-bias"])
def test_layout_parts_rebuild_every_bigtrain_tensor_from_the_files(tmp_path, name):
    _, params, mapping, _ = export_gpt(CONFIGS[name], tmp_path / "out")
    written = written_tensors(tmp_path / "out")
    assert set(written) == set(mapping.hf_shapes())
    assert {n: tuple(t.shape) for n, t in written.items()} == mapping.hf_shapes()
    for bigtrain_name, param in params.items():
        assert torch.equal(mapping.join(bigtrain_name, written.__getitem__), param)
    for hf_name in mapping.extra:  # GPT-2's biases when the model has none
        assert not written[hf_name].any()


def test_small_shards_get_an_index_that_transformers_loads(tmp_path):
    max_bytes = 20_000
    model, _, mapping, files = export_gpt(LLAMA, tmp_path / "out", max_shard_bytes=max_bytes)
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    assert set(weight_map) == set(mapping.hf_shapes()) and set(weight_map.values()) == set(shards)
    total = 0
    for shard in shards:
        tensors = load_file(str(tmp_path / "out" / shard))
        assert {n for n, f in weight_map.items() if f == shard} == set(tensors)
        size = sum(t.numel() * 4 for t in tensors.values())
        assert size <= max_bytes or len(tensors) == 1  # a larger tensor gets a shard alone
        total += size
    assert index["metadata"]["total_size"] == total
    assert check_export(model, tmp_path / "out", VOCAB, LLAMA.seq_len)["ok"]


@pytest.mark.parametrize("cfg", [LLAMA, GPT2], ids=["llama", "gpt2"])
def test_weights_stream_shard_by_shard(tmp_path, cfg):
    """Each tensor is read only once the shards before its own HF tensor's are on disk: memory
    holds one shard plus one tensor (GPT-2: q, k, v and their c_attn), not the model."""
    params = {n: p for n, p in GPT(cfg).named_parameters()}
    mapping = mapping_for(cfg, {n: tuple(p.shape) for n, p in params.items()})
    shards = plan_shards(mapping.hf_shapes(), 20_000)
    shard_of = {hf: i for i, names in enumerate(shards) for hf in names}
    on_disk = []

    def read(name: str) -> torch.Tensor:
        written = [f for d in tmp_path.glob(".out.tmp-export-*") for f in d.glob("*.safetensors")]
        on_disk.append(len(written))
        assert len(written) == shard_of[mapping.parts[name].hf_name], name
        return params[name]

    export_hf(mapping, read, tmp_path / "out", None, max_shard_bytes=20_000)
    assert len(on_disk) == len(params) and on_disk[-1] == len(shards) - 1 > 2


def test_a_wrong_layout_fails_the_check(tmp_path):
    torch.manual_seed(0)
    model = GPT(LLAMA)
    params = trained_like(model)
    mapping = mapping_for(LLAMA, {n: tuple(p.shape) for n, p in params.items()})
    gate, up = mapping.parts["blocks.1.mlp.gate.weight"], mapping.parts["blocks.1.mlp.up.weight"]
    mapping.parts["blocks.1.mlp.gate.weight"] = Part(up.hf_name, up.rows)  # gate as the value
    mapping.parts["blocks.1.mlp.up.weight"] = Part(gate.hf_name, gate.rows)
    export_hf(mapping, params.__getitem__, tmp_path / "out", None)
    result = check_export(model, tmp_path / "out", VOCAB, LLAMA.seq_len)
    assert not result["ok"] and result["max_rel_diff"] > 1e-2


def test_existing_non_empty_out_dir_is_refused_and_left_alone(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="exists and is not empty"):
        export_gpt(GPT2, out)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    (tmp_path / "empty").mkdir()
    assert "model.safetensors" in export_gpt(GPT2, tmp_path / "empty")[3]


def test_a_failed_export_leaves_nothing_behind(tmp_path):
    params = {n: p for n, p in GPT(GPT2).named_parameters()}
    mapping = mapping_for(GPT2, {n: tuple(p.shape) for n, p in params.items()})

    def read(name: str) -> torch.Tensor:
        if name == "blocks.1.attn.k.weight":  # mid-way through c_attn's parts
            raise OSError("checkpoint shard unreadable")
        return params[name]

    with pytest.raises(OSError, match="unreadable"):
        export_hf(mapping, read, tmp_path / "out", None, max_shard_bytes=10_000)
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tokenizer")
    lines = ["To be, or not to be, that is the question:", "Whether 'tis nobler in the mind"]
    train_bpe(lines * 20, 300, out)  # 300: the 256 bytes and EOS plus a few merges
    return out


def test_tokenizer_files_and_token_ids_are_exported(tmp_path, tokenizer_dir):
    from transformers import AutoTokenizer

    cfg = dataclasses.replace(GPT2, vocab_size=300)
    _, _, _, files = export_gpt(
        cfg, tmp_path / "out", tokenizer_dir=tokenizer_dir, generation={"max_new_tokens": 20}
    )
    assert {"tokenizer.json", "generation_config.json", "config.json"} <= set(files)
    source = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    exported = AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert exported("To be, or not")["input_ids"] == source("To be, or not")["input_ids"]
    generation = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert generation["eos_token_id"] == config["eos_token_id"] == source.eos_token_id
    assert generation["max_new_tokens"] == 20


@pytest.mark.parametrize("cfg", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_the_exported_tokenizer_knows_the_models_context_length(tmp_path, tokenizer_dir, cfg):
    """Longer inputs would index past GPT-2's position table (an IndexError in transformers):
    the tokenizer says the length, so transformers truncates or warns instead."""
    from transformers import AutoTokenizer

    export_gpt(
        dataclasses.replace(cfg, vocab_size=300), tmp_path / "out", tokenizer_dir=tokenizer_dir
    )
    saved = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert saved["model_max_length"] == cfg.seq_len == 16
    assert AutoTokenizer.from_pretrained(str(tmp_path / "out")).model_max_length == 16


def test_a_tokenizer_larger_than_the_vocab_is_refused(tmp_path, tokenizer_dir):
    with pytest.raises(ConfigError, match="more than the model's vocab_size 96"):
        export_gpt(GPT2, tmp_path / "out", tokenizer_dir=tokenizer_dir)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_hf_model_exports_in_its_own_class(tmp_path, tied):
    hf_config = {
        "model_type": "llama",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 16,
        "tie_word_embeddings": tied,
    }
    torch.manual_seed(0)
    model = build_model(ModelConfig(kind="hf", hf_config=hf_config, seq_len=16), VOCAB)
    params = trained_like(model)
    # state_dict names list a tied table twice: the mapping writes it once
    shapes = {canonical_name(n): tuple(t.shape) for n, t in model.state_dict().items()}
    mapping = mapping_for_hf(model.hf.config, shapes)
    assert mapping.architecture == "LlamaForCausalLM"
    assert ("hf.lm_head.weight" in mapping.parts) is not tied
    export_hf(mapping, params.__getitem__, tmp_path / "out", None)
    assert check_export(model, tmp_path / "out", VOCAB, 16)["ok"]
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is tied
    assert "_name_or_path" not in config
