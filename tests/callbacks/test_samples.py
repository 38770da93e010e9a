"""Text samples during training (eval.sample_every): what the callback writes, that it leaves
training alone, and that its tokens are those of `bigtrain generate`'s KV cache."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from bigtrain.callbacks.samples import SampleCallback
from bigtrain.config.eval import EvalConfig
from bigtrain.config.schema import ModelConfig
from bigtrain.data.prepare.cache import train_bpe
from bigtrain.errors import ConfigError
from bigtrain.inference import load_checkpoint_model
from bigtrain.model.generate import Sample, Sampling, cached_step, decode, encode_prompt
from bigtrain.model.gpt import GPT
from bigtrain.parallel.env import read_env
from bigtrain.runner import run
from bigtrain.store.rundir import RunDir, read_jsonl
from bigtrain.train.step import StepResult
from tests.callbacks.test_wandb import wandb_logger

PROMPTS = ["To be, or not", ""]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tokenizer")
    text = "To be, or not to be, that is the question.\nWhether 'tis nobler in the mind.\n"
    train_bpe([text] * 20, 300, out)
    return out


class EvalBackend:
    """A backend's eval_logits over a GPT: eval mode for the forward, train mode after."""

    def __init__(self, model: GPT) -> None:
        self.model, self.device = model.train(), torch.device("cpu")
        self.calls = 0
        self.shapes: set[tuple[int, ...]] = set()

    def whole_sequence(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def eval_logits(self, ids: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.shapes.add(tuple(ids.shape))
        self.model.eval()
        try:
            return self.model(ids)
        finally:
            self.model.train()


def _gpt() -> GPT:
    cfg = ModelConfig(n_layers=2, n_heads=2, d_model=32, seq_len=24, vocab_size=300, init_std=0.3)
    return GPT(cfg, init_seed=5)


def _stub_trainer(backend, run_dir: RunDir, step: int, last: bool = False):
    return SimpleNamespace(step=step, backend=backend, run_dir=run_dir, is_last_step=lambda: last)


@pytest.mark.unit
def test_samples_are_the_kv_cache_tokens_and_leave_training_state_alone(tokenizer_dir, tmp_path):
    cfg = EvalConfig(sample_every=4, sample_prompts=PROMPTS, sample_max_new_tokens=10)
    callback = SampleCallback(cfg, str(tokenizer_dir), seq_len=24, seed=1)
    backend, run_dir = EvalBackend(_gpt()), RunDir(tmp_path, is_main=True)
    rng = torch.get_rng_state()
    callback.on_step_end(_stub_trainer(backend, run_dir, step=3), StepResult(3, lr=0.1))
    assert backend.calls == 0  # not due
    result = StepResult(4, lr=0.1)
    callback.on_step_end(_stub_trainer(backend, run_dir, step=4), result)
    assert backend.model.training and torch.equal(torch.get_rng_state(), rng)
    assert backend.calls == 20 and backend.shapes == {(1, 24)}  # one padded shape throughout
    lines = read_jsonl(tmp_path / "samples.jsonl")
    assert [(r["step"], r["prompt"]) for r in lines] == [(4, p) for p in PROMPTS]
    assert [Sample(**{k: v for k, v in r.items() if k != "step"}) for r in lines] == result.samples
    for prompt, sample in zip(PROMPTS, result.samples, strict=True):
        ids = torch.tensor([encode_prompt(callback.tokenizer, prompt)])
        greedy = Sampling(max_new_tokens=10, temperature=0)
        cached = decode(cached_step(backend.model.eval()), ids, greedy, None, 24)
        assert sample.tokens == cached.tokens and len(sample.tokens) == 10
    assert len(set(result.samples[0].tokens)) > 2


@pytest.mark.unit
def test_sampling_above_zero_is_seeded_by_the_step_not_the_training_rng(tokenizer_dir):
    cfg = EvalConfig(sample_every=1, sample_prompts=["To be"], sample_temperature=1.0)
    callback = SampleCallback(cfg, str(tokenizer_dir), seq_len=24, seed=1)
    backend = EvalBackend(_gpt())
    rng = torch.get_rng_state()
    first = callback.sample(backend, step=7)
    torch.manual_seed(123)  # the training generators' state plays no part
    assert callback.sample(backend, step=7) == first
    assert callback.sample(backend, step=8) != first
    torch.set_rng_state(rng)


@pytest.mark.unit
def test_a_prompt_longer_than_the_model_is_refused_at_setup(tokenizer_dir):
    cfg = EvalConfig(sample_every=1, sample_prompts=["fine", "To be, or not to be " * 10])
    with pytest.raises(ConfigError, match=r"'eval.sample_prompts' \[1\] encodes to \d+ tokens"):
        SampleCallback(cfg, str(tokenizer_dir), seq_len=24, seed=1)


@pytest.mark.unit
def test_wandb_gets_the_samples_as_a_table():
    logger, stub = wandb_logger()
    samples = [Sample("To be", ", or", [5, 6], "max_new_tokens")]
    logger.on_step_end(SimpleNamespace(step=4), StepResult(4, lr=0.1, samples=samples))
    (logged,) = stub.logged
    assert logged["train/step"] == 4
    assert logged["samples"].data == [[4, "To be", ", or", "max_new_tokens"]]


@pytest.mark.e2e
def test_sampling_during_training_leaves_the_run_unchanged(micro):
    common = ("train.max_steps=6", "checkpoint.every=6", "precision.compute_dtype=fp32")
    common += ("model.init_std=0.3", "train.eval_every=0")
    plain = run(micro(*common, out="plain"), read_env())
    cfg = micro(
        *common,
        "eval.sample_every=3",
        "eval.sample_prompts=['ROMEO:', '']",
        "eval.sample_max_new_tokens=8",
        out="sampled",
    )
    sampled = run(cfg, read_env())
    assert sampled["fingerprint"] == plain["fingerprint"]  # training unchanged, bit for bit
    lines = read_jsonl(Path(cfg.train.out_dir) / "samples.jsonl")
    assert [(r["step"], r["prompt"]) for r in lines] == [
        (3, "ROMEO:"),
        (3, ""),
        (6, "ROMEO:"),
        (6, ""),
    ]
    # The last samples are the run's final weights through `bigtrain generate`'s KV cache path.
    loaded = load_checkpoint_model(Path(cfg.train.out_dir), device="cpu")
    greedy = Sampling(max_new_tokens=8, temperature=0)
    expected = [s.to_dict() for s in loaded.generate(["ROMEO:", ""], greedy)]
    assert [{k: v for k, v in r.items() if k != "step"} for r in lines[2:]] == expected
    assert len(set(lines[2]["tokens"])) > 2, json.dumps(lines[2])
