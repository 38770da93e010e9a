"""bigtrain's training step against a minimal hand-written PyTorch loop, side by side.

Same model (configs/tiny.yaml unless overridden), same batch size, same autocast dtype, same
optimizer settings. The two loops run in alternating rounds in one process so that machine noise
hits both alike. bigtrain's step includes its data stream, the non-finite check, the callbacks
(metrics at log steps, console off) and gradient clipping; the raw loop does the bare minimum a
correct mixed-precision loop does (autocast, FP32 loss, clip, AdamW).

    python bench/overhead.py [CONFIG ...] [key=value ...] [--steps N] [--rounds R]

Prints tokens/s of both and the ratio (goal: bigtrain >= 0.95 of the raw loop). A third arm, the
same bigtrain run with the gradient checksums off (monitor.checksum.enabled=false), runs in the
same rounds: `checksum_cost` is what checking every step costs (they check steps 1-200 by
default, monitor.checksum.until_step; the endless run's steps all lie within). The last line is
JSON.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import step_bench  # noqa: E402

from bigtrain.build import build_trainer  # noqa: E402
from bigtrain.model import build_model  # noqa: E402
from bigtrain.model.moe import aux_grad_scale  # noqa: E402
from bigtrain.optim.optimizer import adamw_param_groups  # noqa: E402
from bigtrain.parallel.env import DistEnv  # noqa: E402


def raw_loop(cfg, vocab_size: int, tokens: np.ndarray, policy_dtype: torch.dtype):
    """A minimal nanoGPT-style loop; returns a function that runs n steps and returns seconds."""
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model, vocab_size, init_seed=cfg.train.seed)
    opt = torch.optim.AdamW(
        adamw_param_groups(model, cfg.optim.weight_decay),
        lr=cfg.optim.lr,
        betas=(cfg.optim.beta1, cfg.optim.beta2),
        eps=cfg.optim.eps,
        foreach=True,
    )
    seq, batch = cfg.model.seq_len, cfg.train.micro_batch_size
    gen = torch.Generator().manual_seed(0)
    data = torch.from_numpy(tokens[: (len(tokens) // (seq + 1)) * (seq + 1)].astype(np.int64))

    def steps(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            ix = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
            rows = torch.stack([data[i : i + seq + 1] for i in ix.tolist()])
            x, y = rows[:, :-1], rows[:, 1:]
            # An MoE model's auxiliary losses take the loss's gradient scale with the step.
            with aux_grad_scale(model, 1.0):
                autocast = policy_dtype != torch.float32
                with torch.autocast("cpu", dtype=policy_dtype, enabled=autocast):
                    logits = model(x)
                loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    return steps


def main() -> None:
    args = step_bench.parse(__doc__.splitlines()[0], "steps per round and loop")
    cfg = step_bench.endless_config(args.items, "wandb.mode=disabled")
    trainer = build_trainer(cfg, DistEnv())
    unchecked = build_trainer(
        step_bench.endless_config(
            args.items, "wandb.mode=disabled", "monitor.checksum.enabled=false"
        ),
        DistEnv(),
    )
    assert trainer.monitor.checksums is not None, "the checksums are off in this layout"
    policy = trainer.setup.policy
    from bigtrain.data import prepare_corpus

    corpus = prepare_corpus(cfg.data)
    raw = raw_loop(cfg, corpus.vocab_size, np.asarray(corpus.tokens), policy.compute_dtype)

    def bigtrain_steps(n: int, which=trainer) -> float:
        start = time.perf_counter()
        for _ in range(n):
            result = which.train_step()
            which.callbacks.on_step_end(which, result)
        return time.perf_counter() - start

    def unchecked_steps(n: int) -> float:
        return bigtrain_steps(n, unchecked)

    bigtrain_steps(3)  # warm-up all three (allocator, autocast caches)
    unchecked_steps(3)
    raw(3)
    times: dict = {bigtrain_steps: [], raw: [], unchecked_steps: []}
    arms = list(times)
    for r in range(args.rounds):  # rotate which loop goes first, so none always runs warm
        for arm in arms[r % 3 :] + arms[: r % 3]:
            times[arm].append(arm(args.steps))
    t_big, t_raw, t_off = times[bigtrain_steps], times[raw], times[unchecked_steps]
    tokens = args.steps * trainer.tokens_per_step
    # Median over rounds: a 2-core VM has bursts of noise that a sum would charge to one side.
    t_big_med, t_raw_med = float(np.median(t_big)), float(np.median(t_raw))
    result = {
        "bench": "overhead",
        "bigtrain_tokens_per_s": tokens / t_big_med,
        "raw_tokens_per_s": tokens / t_raw_med,
        "ratio": float(np.median(np.array(t_raw) / np.array(t_big))),
        "compute_dtype": str(policy.compute_dtype).replace("torch.", ""),
        "steps": args.rounds * args.steps,
        "ratio_per_round": [round(a / b, 3) for a, b in zip(t_raw, t_big, strict=True)],
        "unchecked_tokens_per_s": tokens / float(np.median(t_off)),
        "checksum_cost": float(np.median(np.array(t_big) / np.array(t_off))) - 1,
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}",
    }
    trainer.callbacks.close()
    unchecked.callbacks.close()
    print(f"bigtrain: {result['bigtrain_tokens_per_s']:.0f} tokens/s")
    print(
        f"bigtrain without gradient checksums: {result['unchecked_tokens_per_s']:.0f} tokens/s "
        f"(checking costs {result['checksum_cost']:+.1%} per step)"
    )
    print(f"raw loop: {result['raw_tokens_per_s']:.0f} tokens/s")
    print(f"ratio bigtrain / raw: {result['ratio']:.3f} (goal >= 0.95)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
