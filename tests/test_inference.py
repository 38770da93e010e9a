"""`bigtrain generate`: a run directory's newest checkpoint, greedy tokens equal to transformers'
generate on the exported model, and bad paths refused with exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bigtrain.checkpoint.export import export_checkpoint
from bigtrain.checkpoint.manifest import CheckpointError, checkpoint_path
from bigtrain.parallel.env import read_env
from bigtrain.runner import run
from tests.conftest import run_cli
from tests.models import GPT_LLAMA_STYLE


@pytest.mark.unit
def test_checkpoint_path_takes_a_checkpoint_or_a_run_directorys_newest(tmp_path):
    run_dir = tmp_path / "run"
    for step in (5, 20, 100):
        (run_dir / "checkpoints" / f"step_{step:08d}").mkdir(parents=True)
        (run_dir / "checkpoints" / f"step_{step:08d}" / "manifest.json").write_text("{}")
    (run_dir / "checkpoints" / ".tmp-step_00000200").mkdir()  # never committed
    newest = run_dir / "checkpoints" / "step_00000100"
    older = run_dir / "checkpoints" / "step_00000020"
    assert checkpoint_path(run_dir, verify=lambda path: {}) == newest
    assert checkpoint_path(older) == older  # a checkpoint as it is: its caller verifies it

    def damaged_newest(path):
        if path == newest:
            raise CheckpointError(f"checkpoint '{path}': sha256 mismatch")
        return {}

    assert checkpoint_path(run_dir, verify=damaged_newest) == older


@pytest.mark.unit
@pytest.mark.parametrize(
    "make",
    [
        lambda p: None,
        lambda p: p.write_text("x"),
        lambda p: p.mkdir(),
        lambda p: (p / "checkpoints").mkdir(parents=True),
    ],
    ids=["missing", "file", "other-directory", "empty-run"],
)
def test_checkpoint_path_says_what_it_expected(tmp_path, make):
    path = tmp_path / "somewhere"
    make(path)
    with pytest.raises(CheckpointError) as error:
        checkpoint_path(path)
    assert str(error.value) == (
        f"'{path}' is neither a checkpoint (no manifest.json) nor a run directory with committed "
        f"checkpoints (no {path}/checkpoints/step_*)"
    )


def _hf_greedy(out: Path, prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    """transformers' own greedy generate on the exported model, EOS dropped as ours drops it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    found = []
    for prompt in prompts:
        ids = tokenizer.encode(prompt, add_special_tokens=False) or [tokenizer.eos_token_id]
        prompt_ids = torch.tensor([ids])
        new = model.generate(
            prompt_ids,
            attention_mask=torch.ones_like(prompt_ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.eos_token_id,
        )[0, len(ids) :].tolist()
        found.append(new[:-1] if new and new[-1] == tokenizer.eos_token_id else new)
    return found


@pytest.mark.e2e
@pytest.mark.parametrize("style", [(), GPT_LLAMA_STYLE], ids=["gpt2", "llama-gqa"])
def test_generate_gives_the_greedy_tokens_of_transformers_on_the_export(micro, tmp_path, style):
    cfg = micro(
        "train.max_steps=3",
        "checkpoint.every=3",
        "train.eval_every=0",
        "precision.compute_dtype=fp32",
        "model.init_std=0.3",  # logits far apart: no greedy choice hangs on a rounding
        *style,
    )
    run(cfg, read_env())
    run_dir = Path(cfg.train.out_dir)
    out = tmp_path / "hf"
    export_checkpoint(run_dir / "checkpoints" / "step_00000003", out, 10**9)
    (tmp_path / "prompts.txt").write_text("\nWhat, ho! Apothecary!\n\n")  # blank lines skipped
    done = run_cli(
        "generate",
        str(run_dir),  # its newest checkpoint: step 3
        "--prompt",
        "ROMEO:",
        "--prompt",
        "",  # a new document: the EOS alone is the context
        "--prompts-file",
        str(tmp_path / "prompts.txt"),
        "--temperature",
        "0",
        "--max-new-tokens",
        "12",
        "--json",
    )
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [line["prompt"] for line in lines] == ["ROMEO:", "", "What, ho! Apothecary!"]
    assert "step 3" in done.stderr and "float32" in done.stderr  # the log goes to stderr
    expected = _hf_greedy(out, [line["prompt"] for line in lines], 12)
    assert [line["tokens"] for line in lines] == expected
    assert all(len(set(tokens)) > 2 for tokens in expected)  # varied text: a check with teeth


@pytest.mark.e2e
def test_generate_refuses_what_is_no_checkpoint_with_exit_2(tmp_path):
    (tmp_path / "notes").mkdir()
    done = run_cli("generate", str(tmp_path / "notes"), "--prompt", "hello")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("bigtrain: error: ") and str(tmp_path / "notes") in line
    assert "is neither a checkpoint (no manifest.json) nor a run directory" in line


@pytest.mark.unit
@pytest.mark.parametrize(
    ("option", "value", "expected"),
    [
        ("--temperature", "-1", "argument --temperature: got -1, expected a number >= 0.0"),
        ("--top-p", "0", "argument --top-p: got 0, expected a number > 0.0 and <= 1.0"),
        ("--top-k", "-3", "argument --top-k: got -3, expected a number >= 0"),
        ("--max-new-tokens", "0", "argument --max-new-tokens: got 0, expected a number >= 1"),
    ],
)
def test_generate_options_out_of_range_exit_2_naming_the_option(capsys, option, value, expected):
    from bigtrain.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["generate", "run", "--prompt", "x", option, value])
    assert exit_.value.code == 2 and expected in capsys.readouterr().err
