"""bigtrain's command-line arguments: one subcommand parser each (bigtrain/cli.py runs them)."""

from __future__ import annotations

import argparse
from pathlib import Path

PATH_HELP = "a checkpoint directory, or a run directory: its newest committed checkpoint"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bigtrain", description="Train GPT-style language models.")
    # The deepspeed launcher runs `python -m bigtrain --local_rank=N train ...`.
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    sub = p.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train from YAML configs and key=value overrides")
    train.add_argument(
        "items",
        nargs="+",
        metavar="CONFIG|key=value",
        help="YAML files merged left to right, then dotted overrides like train.max_steps=100",
    )
    train.add_argument(
        "--local_rank",
        "--local-rank",
        type=int,
        default=None,
        dest="local_rank_sub",
        help=argparse.SUPPRESS,
    )

    prepare = sub.add_parser(
        "prepare",
        help="tokenize a corpus (data.*) into memory-mapped token shards and a manifest",
    )
    prepare.add_argument(
        "items",
        nargs="*",
        metavar="CONFIG|key=value",
        help="YAML files and data.* overrides, as for train (default: Shakespeare, BPE 2048)",
    )
    prepare.add_argument(
        "--out", type=Path, required=True, metavar="DIR", help="a new directory, or one to resume"
    )

    plan = sub.add_parser(
        "plan", help="precision policy and memory per rank, without building the model"
    )
    plan.add_argument("items", nargs="*", metavar="CONFIG|key=value")
    plan.add_argument("--world-size", type=int, default=1, help="ranks to plan for (default 1)")
    plan.add_argument(
        "--gpu-memory",
        default=None,
        help="memory of one GPU, with its unit: 80GiB (nvidia-smi's 81559MiB) or 80GB; also "
        "print the largest micro-batch that fits (planned for an sm90 GPU when run without "
        "one). A bare number is refused: GB and GiB differ by 7%%, which can change the answer",
    )
    plan.add_argument(
        "--propose",
        action="store_true",
        help="with --gpu-memory: also list the layouts (tp x pipeline stages x data parallel) "
        "of --world-size GPUs for this model and global batch, why each fails, and the one "
        "proposed (docs/parallelism.md)",
    )

    _add_goodput_options(plan)
    light = sub.add_parser("lighthouse", help="the lighthouse of fault_tolerance's replica groups")
    light.add_argument("items", nargs="+", metavar="CONFIG|key=value")
    light.add_argument("--port", type=int, default=29510, help="port to listen on (0: any)")
    report = sub.add_parser("report", help="PNG plots and an HTML page from a run directory")
    report.add_argument("run_dir", type=Path)

    _add_config_command(sub)
    _add_checkpoint_commands(sub)
    _generate_parser(sub)
    return p


def _add_goodput_options(plan) -> None:
    """`plan --goodput`: the simulated goodput of a long run (plan/goodput.py)."""
    g = plan.add_argument_group("goodput (docs/goodput.md)")
    g.add_argument("--goodput", action="store_true", help="simulate goodput at --gpus GPUs")
    g.add_argument("--gpus", type=int, default=None, help="GPUs of the planned run")
    g.add_argument(
        "--from",
        dest="from_dir",
        type=Path,
        default=None,
        metavar="RUN_DIR",
        help="take the costs measured in a run directory (its config when no CONFIG is given)",
    )
    g.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set a simulation input (repeatable), e.g. restart_s=180 or rate.hang=1e-6",
    )
    g.add_argument("--json", action="store_true", help="one JSON line instead of the table")
    g.add_argument("--seed", type=int, default=0, help="the Monte Carlo's seed (default 0)")
    g.add_argument("--trials", type=_number(int, 2), default=200, help="simulated runs")


def _add_config_command(sub) -> None:
    """`config show`."""
    config = sub.add_parser("config", help="the resolved config")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    show = config_sub.add_parser(
        "show", help="the config that train would run, merged and checked, as YAML"
    )
    show.add_argument(
        "items", nargs="*", metavar="CONFIG|key=value", help="as for train (none: the defaults)"
    )
    show.add_argument(
        "--docs", action="store_true", help="each key's documentation as a comment above it"
    )


def _add_checkpoint_commands(sub) -> None:
    """`ckpt verify|inspect|convert` and `export`: each takes a checkpoint or a run directory."""
    ckpt = sub.add_parser(
        "ckpt", help="verify, inspect or convert a checkpoint (a run directory: its newest)"
    )
    ckpt_sub = ckpt.add_subparsers(dest="ckpt_command", required=True)
    for name, text in (
        ("verify", "recompute every file's sha256 against the manifest"),
        ("inspect", "print the manifest summary"),
    ):
        c = ckpt_sub.add_parser(name, help=text)
        c.add_argument("path", type=Path, help=PATH_HELP)
    convert = ckpt_sub.add_parser(
        "convert",
        help="rewrite a checkpoint of an earlier bigtrain version in today's format (once)",
    )
    convert.add_argument("path", type=Path, help=PATH_HELP)
    convert.add_argument("out", type=Path, help="a new directory")

    export = sub.add_parser("export", help="a checkpoint as a Hugging Face model directory")
    export.add_argument("path", type=Path, metavar="CHECKPOINT", help=PATH_HELP)
    export.add_argument("--hf", type=Path, required=True, metavar="OUT_DIR", help="a new directory")
    export.add_argument(
        "--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)"
    )
    export.add_argument(
        "--check",
        action="store_true",
        help="load the result with transformers and compare logits with bigtrain's (FP32)",
    )


def _number(kind: type, low: float, high: float | None = None, low_open: bool = False):
    """An argparse type: a `kind` number in [low, high] ((low, high] with low_open)."""

    def parse(text: str):
        value = kind(text)
        if value < low or (low_open and value == low) or (high is not None and value > high):
            above = f"> {low}" if low_open else f">= {low}"
            raise argparse.ArgumentTypeError(
                f"got {text}, expected a number {above}" + (f" and <= {high}" if high else "")
            )
        return value

    return parse


def _generate_parser(sub) -> None:
    gen = sub.add_parser(
        "generate", help="text from a checkpoint (a run directory: its newest checkpoint)"
    )
    gen.add_argument("path", type=Path, metavar="CKPT_OR_RUN_DIR")
    gen.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    gen.add_argument("--prompts-file", type=Path, metavar="FILE", help="one prompt per line")
    gen.add_argument("--max-new-tokens", type=_number(int, 1), default=64, metavar="N")
    gen.add_argument(
        "--temperature", type=_number(float, 0.0), default=1.0, help="0: greedy (default 1)"
    )
    gen.add_argument("--top-k", type=_number(int, 0), default=0, help="0: off (default)")
    gen.add_argument("--top-p", type=_number(float, 0.0, 1.0, low_open=True), default=1.0)
    gen.add_argument("--seed", type=int, default=0, help="seeds each prompt's sampling")
    gen.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    gen.add_argument(
        "--dtype",
        choices=["auto", "fp32", "bf16", "fp16"],
        default="auto",
        help="auto: FP32 on the CPU, the checkpoint's compute dtype on a GPU",
    )
    gen.add_argument(
        "--json", action="store_true", help="one JSON line per prompt: prompt, text, tokens, stop"
    )
