import pytest
import torch

from bigtrain.config import load_config
from bigtrain.config.schema import ModelConfig
from bigtrain.errors import ConfigError
from bigtrain.model import build_model, model_flops_per_token

pytestmark = pytest.mark.unit

TINY_GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 32, "n_positions": 16}


def test_hf_gpt2_from_dict_config():
    torch.manual_seed(0)
    model = build_model(ModelConfig(kind="hf", hf_config=TINY_GPT2, seq_len=16), vocab_size=50)
    assert model.hf.config.vocab_size == 50
    logits = model(torch.randint(0, 50, (2, 16)))
    assert logits.shape == (2, 16, 50)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model_flops_per_token(model, ModelConfig(kind="hf", seq_len=16)) > 0


def test_hf_local_pretrained_directory_loads_the_weights(tmp_path):
    torch.manual_seed(0)
    model = build_model(ModelConfig(kind="hf", hf_config=TINY_GPT2, seq_len=16), vocab_size=50)
    model.hf.save_pretrained(tmp_path / "pretrained")
    loaded = build_model(
        ModelConfig(kind="hf", hf_path=str(tmp_path / "pretrained"), seq_len=16), vocab_size=50
    )
    idx = torch.randint(0, 50, (1, 16))
    torch.testing.assert_close(
        loaded.eval()(idx), model.eval()(idx)
    )  # eval: GPT-2's dropout defaults to 0.1


def test_hf_config_only_directory_builds_fresh_weights(tmp_path):
    torch.manual_seed(0)
    model = build_model(ModelConfig(kind="hf", hf_config=TINY_GPT2, seq_len=16), vocab_size=50)
    model.hf.config.save_pretrained(tmp_path / "cfg-only")
    fresh = build_model(
        ModelConfig(kind="hf", hf_path=str(tmp_path / "cfg-only"), seq_len=16), vocab_size=50
    )
    assert fresh.hf.config.n_layer == 2
    assert not torch.equal(fresh.hf.transformer.wte.weight, model.hf.transformer.wte.weight)


def test_unknown_model_type_names_the_close_matches_only():
    with pytest.raises(ConfigError) as info:
        build_model(ModelConfig(kind="hf", hf_config={"model_type": "gpt3"}), vocab_size=50)
    message = str(info.value)
    assert "unknown model_type 'gpt3'" in message and "gpt2" in message
    assert len(message) < 300  # not the 800 types transformers knows


def test_hf_config_without_spaces_shows_what_yaml_made_of_it():
    with pytest.raises(ConfigError) as info:
        load_config([], ["model.kind=hf", "model.hf_config={model_type:gpt2,n_layer:2}"])
    message = str(info.value)
    assert "{'model_type:gpt2': None, 'n_layer:2': None}" in message
    assert "model.hf_config='{model_type: gpt2, n_layer: 2}'" in message


@pytest.mark.unit
def test_document_mask_needs_the_builtin_gpt():
    import dataclasses

    from bigtrain.config import load_config
    from bigtrain.errors import ConfigError
    from bigtrain.parallel.layout import Layout
    from bigtrain.parallel.model_setup import make_model

    cfg = load_config([], ["data.document_mask=true", "model.seq_len=16"])
    cfg = dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, kind="hf", hf_config=TINY_GPT2)
    )
    with pytest.raises(ConfigError, match="data.document_mask=true needs model.kind=gpt"):
        make_model(cfg, Layout(1), 50, torch.device("cpu"), eos_id=0)
    plain = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, kind="gpt"))
    model, _ = make_model(plain, Layout(1), 50, torch.device("cpu"), eos_id=7)
    assert model.document_eos == 7
