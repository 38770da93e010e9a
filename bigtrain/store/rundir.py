"""The run directory's files: config.yaml, metrics.jsonl, events.jsonl, final.json, markers.

Only rank 0 writes the shared files; every rank may read them. Each JSONL line is written whole and
flushed, so a killed run leaves readable logs up to its last step.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from bigtrain.errors import ConfigError

ABORTED = "ABORTED"
DIFFER = "REPLICAS_DIFFER"


def _clean(value: Any) -> Any:
    """JSON has no NaN/Inf: write them as strings so that the line stays valid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


class RunDir:
    def __init__(self, path: Path, is_main: bool, group: int | None = None) -> None:
        """`group`: this process's fault-tolerant replica group (parallel/replicas/groups.py), which every
        event line carries; each group's rank 0 writes its events, and only the group that
        leads the current quorum (`leader`, set each step) writes metrics, samples and
        final.json. None: a run without replica groups (rank 0 writes everything)."""
        self.path = path
        self.is_main = is_main
        self.group = group
        self.leader = group is None
        if is_main:
            path.mkdir(parents=True, exist_ok=True)

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    def per_group(self, name: str) -> Path:
        """RUN_DIR/<name> for files each rank writes under its rank's name (logs, hang stacks):
        with replica groups RUN_DIR/<name>/group<g>, since every group has a rank 0."""
        return self.path / name if self.group is None else self.path / name / f"group{self.group}"

    @property
    def aborted_marker(self) -> Path:
        return self.path / ABORTED

    @property
    def differ_marker(self) -> Path:
        """Replica groups ended with different weights (parallel/replicas/groups.py): a restarted group
        exits 7 at once instead of finishing alone with its own."""
        return self.path / DIFFER

    def _append(self, name: str, record: dict[str, Any], any_rank: bool = False) -> None:
        if not (self.is_main or any_rank):
            return
        with open(self.path / name, "a") as f:
            f.write(json.dumps(_clean(record)) + "\n")  # one write of a whole line
            f.flush()

    def metrics(self, record: dict[str, Any]) -> None:
        if self.leader:
            self._append("metrics.jsonl", record)

    def sample(self, record: dict[str, Any]) -> None:
        """A line of samples.jsonl: text generated during training (callbacks/samples.py)."""
        if self.leader:
            self._append("samples.jsonl", record)

    def event(
        self, step: int, kind: str, /, any_rank: bool = False, **details: Any
    ) -> dict[str, Any]:
        """Append an event (rank 0; `any_rank`: from this rank too, for what only it can tell,
        such as its own hang)."""
        assert not {"time", "step", "kind"} & set(details), (
            f"reserved event keys in {sorted(details)}"
        )
        record = {"time": time.time(), "step": step, "kind": kind, **details}
        if self.group is not None:
            record.setdefault("group", self.group)
        self._append("events.jsonl", record, any_rank)
        return record

    def write_text(self, name: str, text: str) -> None:
        if self.is_main:
            tmp = self.path / f".{name}.tmp"
            tmp.write_text(text)
            os.replace(tmp, self.path / name)

    def write_json(self, name: str, data: dict[str, Any]) -> None:
        if self.leader:
            self.write_text(name, json.dumps(_clean(data), indent=1) + "\n")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def check_out_dir(out: Path) -> None:
    """train.out_dir must be a directory or a path where one can be made."""
    for path in (out, *out.parents):
        if path.exists():
            if not path.is_dir():
                what = "train.out_dir" if path == out else f"train.out_dir's parent '{path}'"
                raise ConfigError(
                    f"key 'train.out_dir' ({out}): {what} is an existing file, expected a "
                    "directory (or a path where one can be created)"
                )
            return
