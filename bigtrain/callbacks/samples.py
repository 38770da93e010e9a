"""Text samples from the training model every `eval.sample_every` steps and at the last step.

Every rank decodes together: under FSDP2 or ZeRO-3 each forward gathers the sharded weights, so
no rank can generate alone. Each new token recomputes the whole sequence through the backend's
`eval_logits` (eval mode, its autocast; the GPT's document mask applies as in training), and
every rank goes on with rank 0's token, so that all feed the same tokens and stop at the same
EOS. Each forward reads one sequence of model.seq_len tokens: the tokens so far, then EOS
padding, which the causal mask keeps out of their logits. One shape for every forward: tensor
parallelism's sequence shards divide it, a compiled model compiles it once. A few prompts of a
few dozen tokens cost that many forwards of one sequence, every `sample_every` steps: no KV
cache is needed here, nor one per backend. Training is unchanged: no gradients, no draw from the training
generators (sampling above temperature 0 draws from a private generator seeded by train.seed and
the step), and eval_logits puts the model back in train mode. Rank 0 writes RUN_DIR/samples.jsonl;
wandb reads `StepResult.samples`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from bigtrain.config.eval import EvalConfig
from bigtrain.data.prepare.cache import load_tokenizer
from bigtrain.errors import ConfigError
from bigtrain.model.generate import (
    Sample,
    Sampling,
    as_sample,
    decode,
    encode_prompt,
    recompute_step,
)
from bigtrain.train.hooks import Callback
from bigtrain.train.step import StepResult
from bigtrain.utils.dist import from_rank0
from bigtrain.utils.seeds import derived_seed


class SampleCallback(Callback):
    def __init__(self, cfg: EvalConfig, tokenizer_dir: str, seq_len: int, seed: int) -> None:
        """`tokenizer_dir`: the run's tokenizer; `seq_len`: positions a sequence may fill
        (model.seq_len); `seed`: train.seed."""
        self.every, self.max_len, self.seed = cfg.sample_every, seq_len, seed
        self.sampling = Sampling(cfg.sample_max_new_tokens, cfg.sample_temperature)
        self.tokenizer = load_tokenizer(tokenizer_dir)
        self.prompts = [(p, encode_prompt(self.tokenizer, p)) for p in cfg.sample_prompts]
        for i, (_, ids) in enumerate(self.prompts):
            if len(ids) > seq_len:
                raise ConfigError(
                    f"key 'eval.sample_prompts' [{i}] encodes to {len(ids)} tokens, more than "
                    f"model.seq_len={seq_len}: expected a shorter prompt"
                )

    def due(self, trainer) -> bool:
        return self.every > 0 and (trainer.step % self.every == 0 or trainer.is_last_step())

    def on_step_end(self, trainer, result: StepResult) -> None:
        if not self.due(trainer):
            return
        result.samples = self.sample(trainer.backend, trainer.step)
        for sample in result.samples:  # rank 0 writes
            trainer.run_dir.sample({"step": trainer.step, **sample.to_dict()})

    @torch.no_grad()
    def sample(self, backend, step: int) -> list[Sample]:
        """One sample per prompt from the backend's model; every rank calls this together."""
        device = backend.device
        generator = None
        if self.sampling.temperature > 0:
            generator = torch.Generator(device=device)
            generator.manual_seed(derived_seed("samples", self.seed, step))

        eos_id = self.tokenizer.eos_token_id

        def logits_of(ids: torch.Tensor) -> torch.Tensor:
            length = ids.shape[1]
            logits = backend.eval_logits(F.pad(ids, (0, self.max_len - length), value=eos_id))
            if isinstance(logits, DTensor):  # tensor parallel: split by vocabulary
                logits = logits.full_tensor()
            return backend.whole_sequence(logits)[:, :length].float()  # context parallel

        samples = []
        for prompt, ids in self.prompts:
            tokens = torch.tensor([ids], device=device)
            generation = decode(
                recompute_step(logits_of),
                tokens,
                self.sampling,
                eos_id,
                self.max_len,
                generator,
                agree=from_rank0,
            )
            samples.append(as_sample(self.tokenizer, prompt, ids, generation))
        return samples
