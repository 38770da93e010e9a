"""Generation with the GPT's KV cache against recomputing the whole prefix for each token.

    python bench/generate.py [--new-tokens N] [--prompt-tokens P] [--reps R] [--threads T]
                             [--device cpu|cuda]

One GPT (GPT-2 style, 6 layers, d_model 384, 6 heads, seq_len 1024, vocab 8192; FP32) decodes
N greedy tokens after a P-token prompt twice, in alternating rounds in one process: with the
KV cache (`cached_step`, one position per token) and by recomputing the sequence
(`recompute_step`, what the samples during training do). Both must give the same tokens. Prints
tokens/s of each and the ratio; the last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bigtrain.config.schema import ModelConfig  # noqa: E402
from bigtrain.model.generate import Sampling, cached_step, decode, recompute_step  # noqa: E402
from bigtrain.model.gpt import GPT  # noqa: E402

CONFIG = ModelConfig(
    n_layers=6, n_heads=6, d_model=384, seq_len=1024, vocab_size=8192, init_std=0.3
)


def timed(step_of, model: GPT, prompt: torch.Tensor, sampling: Sampling, device) -> tuple:
    """(seconds, tokens) of one greedy generation."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    out = decode(step_of(model), prompt, sampling, None, CONFIG.seq_len)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started, out.tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads; 0: default")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model = GPT(CONFIG, init_seed=0).to(device).eval()
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, CONFIG.vocab_size, (1, args.prompt_tokens), generator=generator)
    prompt = prompt.to(device)
    sampling = Sampling(max_new_tokens=args.new_tokens, temperature=0.0)
    steps = {"kv_cache": cached_step, "recompute": recompute_step}
    seconds: dict[str, list[float]] = {name: [] for name in steps}
    tokens: dict[str, list[int]] = {}
    timed(cached_step, model, prompt, Sampling(max_new_tokens=4, temperature=0.0), device)  # warm
    for _ in range(args.reps):
        for name, step_of in steps.items():
            took, tokens[name] = timed(step_of, model, prompt, sampling, device)
            seconds[name].append(took)
    assert tokens["kv_cache"] == tokens["recompute"], "the two paths disagree"
    rate = {name: args.new_tokens / statistics.median(s) for name, s in seconds.items()}
    result = {
        "device": str(device),
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "tokens_per_s": {name: round(r, 1) for name, r in rate.items()},
        "ratio": round(rate["kv_cache"] / rate["recompute"], 2),
        "same_tokens": True,
    }
    for name, r in rate.items():
        print(f"{name:>9}: {r:8.1f} tokens/s")
    print(f"KV cache / recompute: {result['ratio']:.2f}x")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
