"""Fault-tolerant replica groups on CPU/gloo (configs/tiny.yaml, 3 groups of 1 process): what they
cost when nothing fails, and what a failure costs.

    python bench/ft.py [--kills 10] [--pg-kills 3] [--steps 30] [--heartbeat 1]

1. Throughput: tokens/s of the FT run (3 groups through launch/ft.sh, all taking part) against
   the plain fsdp run of the same 3 data-parallel ranks (torchrun), side by side: each run's
   global tokens per step over its median step time (goal FT >= 0.85x).
2. Kills (HTTP transport): a long FT run; the bench SIGKILLs the process of group 1 or 2 (in
   turn) at a random point of a step, `--kills` times, each once the last one has rejoined.
   kill -> survivors' next commit (the leading group 0's next metrics line, polled every 10 ms),
   that is, the first commit of a step whose quorum left the dead group out, p50 and p95 (goal
   p95 <= 3 s at a 1 s heartbeat timeout); kill -> the rejoined group's first commit, split into
   torchrun's restart (kill to its new process, seen by the bench's 10 ms polls), bigtrain's
   start-up (the new process to its join, less the transfer: interpreter, imports, build,
   checkpoint, quorum), the state transfer (`group_joined`), and its first step; MB/s. The
   run's logged steps are scanned for one-step loss outliers (1.2x the median of the four steps
   around it; `loss_outliers`, each with every group's own loss of that step).
3. The same kills, fewer, with the process-group transport: its transfer MB/s.
4. No fault, a noisy neighbour: a run of `--jitter-steps` steps with group 1 sleeping up to
   `--jitter` seconds after each step (`drill.jitter_s`, late for the next quorum), and one with
   group 2's forward+backward `--slow` seconds slower (`drill.slow_s`): `spurious_drops_per_1k`,
   the live groups left out of a quorum per 1,000 steps (`group_left` events of the leading
   group; goal 0), the tokens they skipped, and whether the groups ended with one fingerprint.

The last line is JSON. CPU numbers: 2 cores shared by 3 processes; the restart is dominated by
the interpreter's imports, which a GPU machine pays alike.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bigtrain.config.fault_tolerance import FaultToleranceConfig  # noqa: E402
from bigtrain.parallel.env import free_port  # noqa: E402
from bigtrain.store.rundir import read_jsonl  # noqa: E402

COMMON = [
    "configs/tiny.yaml",
    "parallel.backend=fsdp",
    "train.progress=false",
    "train.log_every=1",
    "train.eval_every=0",
    "checkpoint.every=0",
    "wandb.mode=disabled",
    "train.num_threads=1",
]


def env() -> dict[str, str]:
    out = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        out.pop(var, None)
    return out


def ft_command(out: Path, logs: Path, *overrides: str, restarts: int = 0) -> list[str]:
    return [
        "env",
        f"FT_LOG_DIR={logs}",
        "bash",
        "launch/ft.sh",
        "--groups",
        "3",
        "--max-restarts",
        str(restarts),
        *COMMON,
        f"train.out_dir={out}",
        *overrides,
    ]


def tokens_per_s(out: Path) -> float:
    final = json.loads((out / "final.json").read_text())
    per_step = final["tokens"] / final["step"]
    return per_step / final["costs"]["median_step_s"]


def throughput(work: Path, steps: int) -> dict[str, float]:
    """Tokens/s of the fault-free FT run and the plain run, one after the other."""
    plain_out, ft_out = work / "plain", work / "ft"
    subprocess.run(
        [
            "torchrun",
            "--nproc-per-node",
            "3",
            "--master-port",
            str(free_port()),
            "-m",
            "bigtrain",
            "train",
            *COMMON,
            f"train.out_dir={plain_out}",
            f"train.max_steps={steps}",
        ],
        cwd=ROOT,
        env=env(),
        check=True,
        capture_output=True,
    )
    subprocess.run(
        ft_command(
            ft_out, work / "ft-logs", f"train.max_steps={steps}", "fault_tolerance.min_groups=3"
        ),
        cwd=ROOT,
        env=env(),
        check=True,
        capture_output=True,
    )
    plain, ft = tokens_per_s(plain_out), tokens_per_s(ft_out)
    return {
        "plain_tokens_per_s": round(plain, 1),
        "ft_tokens_per_s": round(ft, 1),
        "ft_over_plain": round(ft / plain, 3),
    }


def worker_pid(group: int) -> int | None:
    """The training process (not torchrun's agent) of a replica group."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        ours = b"bigtrain" in cmd and b"train" in cmd and not any(b"torchrun" in c for c in cmd)
        if ours and f"BIGTRAIN_FT_GROUP={group}".encode() in environ:
            return int(entry.name)
    return None


class Lines:
    """metrics.jsonl's lines as they arrive, with the time the bench saw each."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.seen = path, 0, []  # (time, step)

    def poll(self) -> None:
        if not self.path.exists():
            return
        with open(self.path) as f:
            f.seek(self.offset)
            text = f.read()
        done = text.rfind("\n") + 1
        self.offset += done
        now = time.time()
        self.seen += [(now, json.loads(line)["step"]) for line in text[:done].splitlines()]

    def after(self, t: float) -> tuple[float, int] | None:
        return next(((s, step) for s, step in self.seen if s > t), None)


def wait_for(predicate, lines: Lines, timeout: float) -> None:
    deadline = time.time() + timeout
    while not predicate():
        lines.poll()
        if time.time() > deadline:
            raise TimeoutError("the FT run did not get there in time")
        time.sleep(0.01)


def joined_after(out: Path, group: int, t: float) -> dict | None:
    return next(
        (
            e
            for e in read_jsonl(out / "events.jsonl")
            if e["kind"] == "group_joined" and e["group"] == group and e["time"] > t
        ),
        None,
    )


def wait_for_new_process(group: int, old: int, lines: Lines, timeout: float) -> float:
    """When torchrun's new process of the group appeared (the bench's clock, 10 ms polls)."""
    deadline = time.time() + timeout
    while worker_pid(group) in (None, old):
        lines.poll()
        if time.time() > deadline:
            raise TimeoutError(f"group {group} was not restarted")
        time.sleep(0.01)
    return time.time()


def shrunk_quorum(out: Path, group: int, t: float) -> dict | None:
    """The first quorum after `t` without `group` (or the leader's `group_left` for it): the
    survivors' step without it. None, with the events printed, when there was none."""
    events = read_jsonl(out / "events.jsonl")
    found = next(
        (
            e
            for e in events
            if e["time"] > t
            and (
                (e["kind"] == "quorum" and group not in e["participants"])
                or (e["kind"] == "group_left" and e["group"] == group)
            )
        ),
        None,
    )
    if found is None:
        print(f"no quorum without group {group} after the kill: {events[-12:]}", flush=True)
    return found


def kills(
    work: Path, name: str, count: int, heartbeat: float, transport: str, join: float | None
) -> list[dict]:
    """`count` kills of group 1 or 2 in a long FT run; one record per kill."""
    out = work / name
    proc = subprocess.Popen(
        ft_command(
            out,
            work / f"{name}-logs",
            "train.max_steps=100000",
            f"fault_tolerance.heartbeat_timeout_s={heartbeat}",
            f"fault_tolerance.transport={transport}",
            *([f"fault_tolerance.join_timeout_s={join}"] if join is not None else []),
            restarts=count + 2,
        ),
        cwd=ROOT,
        env=env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    lines, records, rng = Lines(out / "metrics.jsonl"), [], random.Random(0)
    try:
        wait_for(lambda: len(lines.seen) >= 5, lines, 300)
        for i in range(count):
            group = 1 + i % 2
            time.sleep(1.0 + rng.random())  # a random point of some step
            pid = worker_pid(group)
            assert pid is not None, f"no process of group {group}"
            killed = time.time()
            os.kill(pid, signal.SIGKILL)
            restarted = wait_for_new_process(group, pid, lines, 120)
            wait_for(lambda g=group, k=killed: joined_after(out, g, k) is not None, lines, 300)
            joined = joined_after(out, group, killed)
            shrunk = shrunk_quorum(out, group, killed)
            step = joined["step"]
            wait_for(lambda n=step: any(s >= n for _, s in lines.seen), lines, 120)
            first = next(t for t, s in lines.seen if s >= step)
            if shrunk is None:
                continue
            survivors = next(t for t, s in lines.seen if s >= shrunk["step"] and t > killed)
            records.append(
                {
                    "group": group,
                    "survivors_next_commit_s": round(survivors - killed, 3),
                    "rejoin_first_commit_s": round(first - killed, 3),
                    "restart_s": round(restarted - killed, 3),
                    "startup_s": round(joined["time"] - restarted - joined["transfer_s"], 3),
                    "transfer_s": joined["transfer_s"],
                    "first_step_s": round(first - joined["time"], 3),
                    "bytes": joined["bytes"],
                }
            )
            print(f"kill {i + 1}/{count} ({transport}): {records[-1]}", flush=True)
    finally:
        proc.terminate()  # launch/ft.sh stops its torchruns, which stop their workers
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    steps = len({s for _, s in lines.seen})
    outliers = loss_outliers(out)
    print(f"{transport}: {steps} steps logged, loss outliers: {outliers}", flush=True)
    for r in records:
        r.update(logged_steps=steps, loss_outliers=len(outliers))
    return records


def noisy(work: Path, name: str, steps: int, *drill: str) -> dict:
    """A fault-free run with one group made late (or slow): the groups it left out."""
    out = work / name
    subprocess.run(
        ft_command(out, work / f"{name}-logs", f"train.max_steps={steps}", *drill),
        cwd=ROOT,
        env=env(),
        check=True,
        capture_output=True,
    )
    events = read_jsonl(out / "events.jsonl")
    left = [e for e in events if e["kind"] == "group_left" and e.get("reported_by") != e["group"]]
    finishes = {e["group"]: e["fingerprint"] for e in events if e["kind"] == "finish"}
    final = json.loads((out / "final.json").read_text())
    return {
        "steps": steps,
        "drill": " ".join(drill),
        "spurious_drops": len(left),
        "spurious_drops_per_1k": round(1000 * len(left) / steps, 2),
        "tokens_skipped": sum(final.get("tokens_skipped_by_group", {}).values()),
        "groups_finished": len(finishes),
        "one_fingerprint": len(set(finishes.values())) == 1,
    }


def loss_outliers(out: Path, factor: float = 1.2) -> list[dict]:
    """Logged steps whose loss is `factor` x the median of the four steps around it (the "one-step
    outliers" once seen after failures), with each group's own loss of that step."""
    curve = {r["step"]: r for r in read_jsonl(out / "metrics.jsonl") if "loss" in r}
    found = []
    for step, record in sorted(curve.items()):
        around = [curve[s]["loss"] for s in (step - 2, step - 1, step + 1, step + 2) if s in curve]
        if len(around) >= 3 and record["loss"] > factor * statistics.median(around):
            found.append(
                {
                    "step": step,
                    "loss": record["loss"],
                    "around": statistics.median(around),
                    "loss_by_group": record.get("loss_by_group"),
                }
            )
    return found


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(records: list[dict], heartbeat: float, join: float | None) -> dict:
    stall = [r["survivors_next_commit_s"] for r in records]
    mb_s = [r["bytes"] / 1e6 / r["transfer_s"] for r in records if r["transfer_s"] > 0]
    keys = ("rejoin_first_commit_s", "restart_s", "startup_s", "transfer_s", "first_step_s")
    return {
        "kills": len(records),
        "survivors_next_commit_p50_s": quantile(stall, 0.5),
        "survivors_next_commit_p95_s": quantile(stall, 0.95),
        "heartbeat_timeout_s": heartbeat,
        "join_timeout_s": FaultToleranceConfig().join_timeout_s if join is None else join,
        **{
            f"{k.removesuffix('_s')}_median_s": round(statistics.median(r[k] for r in records), 3)
            for k in keys
        },
        "transfer_mb_per_s": round(statistics.median(mb_s), 1) if mb_s else None,
        "logged_steps": records[0]["logged_steps"] if records else 0,
        "loss_outliers": records[0]["loss_outliers"] if records else 0,
        "state_mb": round(records[0]["bytes"] / 1e6, 2) if records else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=10)
    p.add_argument("--pg-kills", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--heartbeat", type=float, default=1.0)
    p.add_argument(
        "--join", type=float, default=None, help="the lighthouse's join timeout (s; the config's)"
    )
    p.add_argument("--jitter-steps", type=int, default=100)
    p.add_argument("--jitter", type=float, default=2.0, help="group 1's delay, up to (s)")
    p.add_argument("--slow", type=float, default=1.5, help="group 2's slower step (s)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bigtrain-bench-ft-") as tmp:
        work = Path(tmp)
        result: dict = {}
        if args.steps:
            result["throughput"] = throughput(work, args.steps)
            print(f"throughput: {result['throughput']}", flush=True)
        if args.kills:
            http = kills(work, "http", args.kills, args.heartbeat, "http", args.join)
            result["http"] = summary(http, args.heartbeat, args.join)
        if args.pg_kills:
            pg = kills(work, "pg", args.pg_kills, args.heartbeat, "pg", args.join)
            result["pg"] = summary(pg, args.heartbeat, args.join)
        if args.jitter_steps:
            late = ("drill.group=1", f"drill.jitter_s={args.jitter}")
            slow = ("drill.group=2", "drill.slow_rank=0", f"drill.slow_s={args.slow}")
            result["jitter"] = noisy(work, "jitter", args.jitter_steps, *late)
            print(f"jitter: {result['jitter']}", flush=True)
            result["slow_group"] = noisy(work, "slow", args.jitter_steps, *slow)
            print(f"slow group: {result['slow_group']}", flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
