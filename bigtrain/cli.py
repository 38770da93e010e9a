"""bigtrain's command line: train | prepare | plan | lighthouse | report | ckpt | export | generate |
config (the arguments: cli_args.py).

Exit codes (README, Exit codes): 0 finished; 2 bad config or input (one line, no traceback); 3
gave up after anomalies (ABORTED marker); 4 preempted after a checkpoint (requeue); 5 a hang; 6 a
excluded host; 7 ranks ended with different weights; 8 a rank ran out of memory (an `oom` event);
anything else is a crash.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from bigtrain.cli_args import parser as _parser
from bigtrain.errors import (
    HANG_EXIT_CODE,
    AbortRun,
    ConfigError,
    HostExcluded,
    OutOfMemory,
    Preempted,
    ReplicaMismatch,
    SharedConfigError,
)

PREPARE_SHOWN = 5  # inputs named in the prepare summary (all are in its inputs list)


def _load(items: list[str]):
    """The config of YAML files and key=value overrides, merged and validated: the one path of
    train, prepare, plan and config show."""
    from bigtrain.config import load_config

    return load_config([i for i in items if "=" not in i], [i for i in items if "=" in i])


def _launched_rank() -> int:
    """This process's rank as the launcher set it (0 without one), read without torch."""
    for name in ("RANK", "SLURM_PROCID"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def _train(items: list[str], local_rank: int | None) -> int:
    try:
        cfg = _load(items)  # a bad config fails before torch is imported (seconds)
    except ConfigError as e:  # every rank reads the same config: rank 0 says it
        raise SharedConfigError(str(e)) from None
    from bigtrain.parallel.env import read_env
    from bigtrain.runner import run
    from bigtrain.utils.logs import setup_console

    env = read_env(local_rank)
    setup_console(env.rank)
    final = run(cfg, env, memory_plan=lambda: _memory_plan(cfg, env))
    if env.is_main:
        print(json.dumps(final))
    return 0


def _memory_plan(cfg, env) -> dict:
    """`bigtrain plan`'s memory per rank for the run's config, on its device (an `oom` event)."""
    from bigtrain.parallel.env import pick_device
    from bigtrain.plan.footprint import planned
    from bigtrain.plan.stages import planned_memory
    from bigtrain.precision import detect_hardware

    hardware = detect_hardware(pick_device(cfg.train.device, env))
    return planned_memory(planned(cfg, env.world_size, hardware))


def _prepare(items: list[str], out: Path) -> int:
    cfg = _load(items)  # before the heavy imports, as in _train
    from bigtrain.data.prepare.run import prepare
    from bigtrain.utils.logs import setup_console

    setup_console(0)
    started = time.perf_counter()
    manifest = prepare(cfg.data, out)
    inputs = (out / manifest["inputs"]).read_text().splitlines()
    summary = {
        "out": str(out),
        "source": cfg.data.source,
        "num_inputs": manifest["num_inputs"],
        "first_inputs": inputs[:PREPARE_SHOWN],
        "inputs_list": str(out / manifest["inputs"]),  # every input, one per line
        "skipped_files": {k: v["count"] for k, v in manifest["skipped_files"].items()},
        "skipped_rows": sum(manifest["skipped_rows"].values()),
        "num_documents": manifest["num_documents"],
        "num_tokens": manifest["num_tokens"],
        "num_shards": len(manifest["shards"]),
        "dtype": manifest["dtype"],
        "vocab_size": manifest["vocab_size"],
        "seconds": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(summary))
    return 0


def _plan(items: list[str], world_size: int, gpu_memory: str | None, propose: bool) -> int:
    if world_size < 1:
        raise ConfigError(f"--world-size got {world_size}, expected a positive integer")
    cfg = _load(items)  # before the heavy imports, as in _train
    from bigtrain.parallel.env import DistEnv, pick_device
    from bigtrain.plan.footprint import planned
    from bigtrain.plan.text import parse_bytes, plan_text
    from bigtrain.precision import Hardware, detect_hardware

    memory = parse_bytes(gpu_memory) if gpu_memory is not None else None
    device = pick_device(cfg.train.device, DistEnv())
    hardware = detect_hardware(device)
    if memory is not None and device.type != "cuda":
        hardware = Hardware("cuda", "an sm90 GPU (planned)", cuda_capability=(9, 0))
    if propose and memory is None:
        raise ConfigError("--propose needs --gpu-memory: the memory a layout must fit in")
    # A proposal's table holds the per-rank batch where the config's own layout does not divide
    # the global batch at this size (what the proposal answers), as the goodput plan does.
    run = planned(cfg, world_size, hardware, global_batch=not propose)
    print(plan_text(run, memory, propose))
    return 0


def _plan_goodput(args: argparse.Namespace) -> int:
    from bigtrain.plan.goodput import plan_goodput

    if args.gpus is None:
        raise ConfigError("--goodput needs --gpus N: the GPUs of the planned run")
    items = list(args.items)
    if args.from_dir is not None and not (args.from_dir / "events.jsonl").is_file():
        raise ConfigError(f"--from: '{args.from_dir / 'events.jsonl'}' does not exist")
    if not [i for i in items if "=" not in i] and args.from_dir is not None:
        items.insert(0, str(args.from_dir / "config.yaml"))  # the run's own config
    plan = plan_goodput(_load(items), args.gpus, args.from_dir, args.sets, args.trials, args.seed)
    print(json.dumps(plan.to_json()) if args.json else plan.text())
    return 0


def _config_show(items: list[str], docs: bool) -> int:
    from bigtrain.config import to_dict, to_yaml
    from bigtrain.config.docs import yaml_with_docs

    cfg = _load(items)
    print(yaml_with_docs(to_dict(cfg)) if docs else to_yaml(cfg), end="")
    return 0


def _export(path: Path, out: Path, max_shard_size: str, check: bool) -> int:
    from bigtrain.checkpoint.export import export_checkpoint
    from bigtrain.utils.logs import setup_console
    from bigtrain.utils.sizes import parse_size

    setup_console(0)
    result = export_checkpoint(path, out, parse_size(max_shard_size, "--max-shard-size"), check)
    print(json.dumps(result))
    if check and not result["check"]["ok"]:
        print("bigtrain: export check failed: the logits differ (see check)", file=sys.stderr)
        return 1
    return 0


def _generate(args: argparse.Namespace) -> int:
    from bigtrain.inference import load_checkpoint_model
    from bigtrain.model.generate import Sampling
    from bigtrain.utils.logs import setup_console

    setup_console(0, sys.stderr)  # stdout holds the generated text alone
    prompts = list(args.prompt)
    if args.prompts_file is not None:
        if not args.prompts_file.is_file():
            raise ConfigError(f"--prompts-file '{args.prompts_file}' is not a file")
        lines = args.prompts_file.read_text().splitlines()
        prompts += [line for line in lines if line.strip()]
    if not prompts:
        raise ConfigError("no prompt: expected --prompt TEXT or --prompts-file FILE")
    sampling = Sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p)
    loaded = load_checkpoint_model(args.path, args.device, args.dtype)
    for number, sample in enumerate(loaded.generate(prompts, sampling, args.seed)):
        if args.json:
            print(json.dumps(sample.to_dict()), flush=True)
        else:
            print(("" if number == 0 else "\n-----\n") + sample.prompt + sample.text, flush=True)
    return 0


def _ckpt(command: str, path: Path, args: argparse.Namespace) -> int:
    from bigtrain.checkpoint.manifest import checkpoint_path, verify

    if command == "convert":
        from bigtrain.checkpoint.convert import convert

        manifest = convert(path, args.out)
        print(f"ok: {args.out} (step {manifest['step']}, {len(manifest['files'])} files)")
        return 0
    path = checkpoint_path(path)
    manifest = verify(path)
    if command == "verify":
        print(f"ok: {path} ({len(manifest['files'])} files verified, step {manifest['step']})")
    else:
        summary = {"path": str(path)} | {
            k: manifest[k]
            for k in (
                "step",
                "backend",
                "world_size",
                "data",
                "config_hash",
                "versions",
                "git_commit",
                "created",
            )
        }
        summary["bytes"] = sum(f["size"] for f in manifest["files"].values())
        print(json.dumps(summary, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    # parse_known_args: overrides may come after options (`plan cfg.yaml --world-size 2 key=value`).
    args, extra = parser.parse_known_args(argv)
    stray = [e for e in extra if e.startswith("-") or "=" not in e or not hasattr(args, "items")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.items += extra
    try:
        if args.command == "train":
            local_rank = args.local_rank if args.local_rank is not None else args.local_rank_sub
            return _train(args.items, local_rank)
        if args.command == "prepare":
            return _prepare(args.items, args.out)
        if args.command == "plan" and args.goodput:
            return _plan_goodput(args)
        if args.command == "plan":
            if not args.items:
                parser.error("plan needs a CONFIG")
            return _plan(args.items, args.world_size, args.gpu_memory, args.propose)
        if args.command == "lighthouse":
            from bigtrain.parallel.replicas.lighthouse import serve_lighthouse

            return serve_lighthouse(_load(args.items).fault_tolerance, args.port)
        if args.command == "report":
            from bigtrain.telemetry.report import build_report

            print(build_report(args.run_dir))
            return 0
        if args.command == "config":
            return _config_show(args.items, args.docs)
        if args.command == "export":
            return _export(args.path, args.hf, args.max_shard_size, args.check)
        if args.command == "generate":
            return _generate(args)
        return _ckpt(args.ckpt_command, args.path, args)
    except (ConfigError, AbortRun, Preempted, ReplicaMismatch, HostExcluded, OutOfMemory) as e:
        # One line, no traceback, the documented exit code; an error every rank finds alike
        # (SharedConfigError) once, from rank 0.
        prefix = {AbortRun: "aborted: ", Preempted: ""}.get(type(e), "error: ")
        if not (isinstance(e, SharedConfigError) and _launched_rank() > 0):
            print(f"bigtrain: {prefix}{e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("bigtrain: interrupted", file=sys.stderr)
        return 130


def entry() -> None:
    """The `bigtrain` console script and `python -m bigtrain`."""
    try:
        code = main()
    except BaseException:
        # A collective that broke because a hung peer ended after this rank's own watchdog fired.
        watchdog = sys.modules.get("bigtrain.callbacks.watchdog")
        if watchdog is not None and watchdog.hang_declared():
            sys.stderr.flush()
            os._exit(HANG_EXIT_CODE)
        raise
    env = sys.modules.get("bigtrain.parallel.env")  # imported only by runs that may go distributed
    if env is not None:
        env.hard_exit_after_distributed(code)
    sys.exit(code)
