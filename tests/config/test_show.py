"""`bigtrain config show`: the resolved config as YAML, with each key's docstring under --docs."""

from __future__ import annotations

import pytest

from bigtrain.cli import main
from bigtrain.config import load_config, to_yaml
from bigtrain.config.docs import field_docs
from bigtrain.config.load import all_keys
from tests.conftest import ROOT, run_cli

TINY = str(ROOT / "configs" / "tiny.yaml")


def show(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["config", "show", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.unit
def test_show_prints_the_merged_config_which_loads_back_the_same(capsys, tmp_path):
    code, out, _ = show(capsys, TINY, "train.max_steps=7", "model.n_layers=2")
    expected = load_config([TINY], ["train.max_steps=7", "model.n_layers=2"])
    assert code == 0 and out == to_yaml(expected)
    shown = tmp_path / "shown.yaml"
    shown.write_text(out)
    assert load_config([str(shown)]) == expected


@pytest.mark.unit
def test_docs_put_each_keys_docstring_above_it_and_still_load_back(capsys, tmp_path):
    # free-form dicts and lists are leaves, dumped whole under their docstring
    overrides = ["train.max_steps=7", "wandb.tags=[a,b]", "model.hf_config={model_type: gpt2}"]
    code, out, _ = show(capsys, TINY, *overrides, "--docs")
    assert code == 0
    lines = out.splitlines()
    at = lines.index("  max_steps: 7")
    doc = "  # Optimizer steps of the whole run; the LR schedule spans them. May change on resume."
    assert lines[at - 1] == doc
    assert lines[lines.index("train:") - 1].startswith("# The run: its directory")
    shown = tmp_path / "shown.yaml"
    shown.write_text(out)
    assert load_config([str(shown)]) == load_config([TINY], overrides)


@pytest.mark.unit
def test_every_key_of_the_schema_has_its_docstring():
    docs = field_docs()
    assert docs["train.max_steps"].startswith("Optimizer steps of the whole run")
    assert docs["data.mixture"] and docs["monitor.loss.factor"]  # nested sections too
    missing = [k for k in all_keys() if not docs.get(k)]
    assert missing == [], missing


@pytest.mark.unit
def test_an_unknown_key_exits_2_with_one_line(capsys):
    code, out, err = show(capsys, TINY, "train.max_stpes=5")
    assert code == 2 and out == ""
    assert err == (
        "bigtrain: error: unknown config key 'train.max_stpes' (did you mean 'train.max_steps'?)\n"
    )


@pytest.mark.e2e
def test_the_cli_shows_the_config_and_refuses_a_missing_file(tmp_path):
    done = run_cli("config", "show", TINY, "--docs", "optim.lr=1e-3")
    assert done.returncode == 0, done.stderr
    assert "  # Peak learning rate, reached at the end of warmup.\n  lr: 0.001\n" in done.stdout
    missing = run_cli("config", "show", str(tmp_path / "nowhere.yaml"))
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1
    assert "nowhere.yaml" in missing.stderr and "Traceback" not in missing.stderr
