"""The evaluation section (`eval.*`): text samples from the training model during a run, and the
checks of its keys that the type alone does not make (called by config/load.py's `validate`).
The validation loss keeps its keys in `train.*` (`eval_every`, `eval_batches`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from bigtrain.errors import ConfigError


@dataclass
class EvalConfig:
    sample_every: int = 0
    """Every N optimizer steps and at the last step, generate text from each of `sample_prompts`
    with the training model: RUN_DIR/samples.jsonl gets one line per prompt (step, prompt, text,
    tokens, stop) and wandb a `samples` table. 0: off. Every rank takes part (the weights may be
    sharded); training is unchanged (eval mode, no gradients, a private generator). May change
    on resume. Read at setup."""
    sample_prompts: list[str] = field(default_factory=lambda: [""])
    """The prompts, encoded as training encoded text. An empty one starts a new document (the
    tokenizer's EOS is its context). Each must encode to at most model.seq_len tokens."""
    sample_max_new_tokens: int = 32
    """Tokens generated per prompt at most; fewer when the model ends the text (EOS) or its
    model.seq_len positions are full (each new token recomputes the whole sequence)."""
    sample_temperature: float = 0.0
    """0: greedy, the most likely token each time (the same text for the same weights). Above 0:
    drawn at this temperature from a generator seeded by train.seed and the step, the same on
    every rank and in a rerun."""


def check_eval(cfg: EvalConfig) -> None:
    """Counts and the temperature in range; prompts to sample from when sampling is on."""
    if cfg.sample_every < 0:
        raise ConfigError(
            f"key 'eval.sample_every' got {cfg.sample_every}, expected N >= 0 (0: off)"
        )
    if cfg.sample_max_new_tokens < 1:
        raise ConfigError(
            f"key 'eval.sample_max_new_tokens' got {cfg.sample_max_new_tokens}, expected >= 1"
        )
    if cfg.sample_temperature < 0:
        raise ConfigError(
            f"key 'eval.sample_temperature' got {cfg.sample_temperature}, expected >= 0 (0: greedy)"
        )
    if cfg.sample_every > 0 and not cfg.sample_prompts:
        raise ConfigError(
            "key 'eval.sample_prompts' is empty but eval.sample_every is set: expected a list "
            "of prompts (an empty string starts a new document)"
        )
