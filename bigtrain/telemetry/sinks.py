"""Metric sinks: where a run's records go besides metrics.jsonl (wandb, TensorBoard, MLflow).

One protocol, `MetricSink`; callbacks/sink_logger.py drives every configured sink from the loop's hooks
with the same records in the same order. What the sinks share lives here once:

- `flat_record`: a metrics record as flat keys (`train/loss`, `layers/grad_norm/00.tok_emb`,
  `timing/data/rank1`, `data/tokens_by_source/<source>`, `memory/peak_bytes/rank1`).
- `HeldRecords`: records wait `log.hold_steps` steps before any sink gets them, so that a rollback
  drops the records of the steps it abandons: every sink's history is the trajectory the run kept,
  with steps increasing (wandb's and MLflow's histories cannot be rewritten).
- `flat_event`: an event as a marker (`events/<kind>` = 1) and its scalar details.
"""

from __future__ import annotations

import importlib.util
from array import array
from bisect import bisect_right
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from bigtrain.errors import ConfigError
from bigtrain.monitor.routers import LAYER_LOAD

STEP_KEY = "train/step"  # the training step in flat records: the x-axis of every chart
PER_SOURCE = ("tokens_by_source",)  # dicts by mixture source name, not by layer
PER_RANK = {"peak_memory_bytes_by_rank": "memory/peak_bytes"}  # lists by rank
PACKAGES = {"wandb": ("wandb",), "tensorboard": ("tensorboard",), "mlflow": ("mlflow",)}
SQL_PACKAGES = ("sqlalchemy", "alembic")  # MLflow's SQLite store (not in mlflow-skinny itself)


@dataclass
class SinkRun:
    """What a sink learns of the run when it starts (rank 0, after setup and resume)."""

    path: Path
    """The run directory."""
    name: str
    """The run's name: the run directory's name."""
    config: dict[str, Any]
    """The resolved config, as nested plain data."""
    policy: dict[str, dict[str, str]]
    """The resolved precision policy: {component: {choice, reason}}."""
    start_step: int
    """The step the run starts from (0, or the resumed checkpoint's step)."""


class MetricSink(Protocol):
    """A destination of the run's records. Every method is called on rank 0 only, in step order
    for records; events come when they happen (a rollback's at the anomaly's step)."""

    name: str

    def start(self, run: SinkRun) -> None:
        """Open the run (continuing the one a restarted run opened) and log config and policy."""

    def log_record(self, step: int, flat: dict[str, Any]) -> None:
        """A kept metrics record of `step` as `flat_record` keys (no STEP_KEY)."""

    def log_event(self, step: int, record: dict[str, Any], flat: dict[str, Any]) -> None:
        """An event (its events.jsonl record) at `step`, and as `flat_event` keys."""

    def log_samples(self, step: int, samples: list) -> None:
        """Text generated at `step` (model/generate.py's Sample: prompt, text, stop)."""

    def log_summary(self, figures: dict[str, Any]) -> None:
        """final.json's figures, once the run finished."""

    def close(self) -> None:
        """Write out and release; called once, on every exit path."""


def require_packages(sinks: list[str], mlflow_uri: str) -> None:
    """ConfigError (exit 2) naming the package and the extra to install for a requested sink
    whose package is missing (`mlflow_uri`: the tracking URI the MLflow sink would use)."""
    for sink in sinks:
        needed = PACKAGES[sink] + (SQL_PACKAGES if mlflow_uri.startswith("sqlite:") else ())
        for package in needed if sink == "mlflow" else PACKAGES[sink]:
            if importlib.util.find_spec(package) is None:
                extra = "wandb" if sink == "wandb" else f"'bigtrain[{sink}]'"
                raise ConfigError(
                    f"key 'log.sinks' asks for {sink}, but the package '{package}' is not "
                    f"installed: pip install {extra}"
                )


def flat_record(record: dict[str, Any]) -> dict[str, Any]:
    """A metrics record as flat keys: the step as `train/step`, scalars under `train/`; per-layer
    dicts as one key per layer under `layers/<metric>/`, prefixed with the layer's position in the
    model so that the keys sort as the layers stack (a layer x step heatmap reads them in order);
    per-rank lists as `timing/<part>/rank<r>` and `memory/peak_bytes/rank<r>`; per-source counts
    as `data/<key>/<source>`; an MoE block's expert shares as `moe/load/<block>/expert<e>`."""
    out: dict[str, Any] = {}
    for key, value in record.items():
        if key == "step_time_by_rank":
            for part, per_rank in value.items():
                out.update({f"timing/{part}/rank{r}": v for r, v in enumerate(per_rank)})
        elif key in PER_RANK:
            out.update({f"{PER_RANK[key]}/rank{r}": v for r, v in enumerate(value)})
        elif key in PER_SOURCE:
            out.update({f"data/{key}/{name}": v for name, v in value.items()})
        elif key == LAYER_LOAD:  # each expert's share of its MoE block's routed tokens
            for block, shares in value.items():
                out.update({f"moe/load/{block}/expert{e}": s for e, s in enumerate(shares)})
        elif isinstance(value, dict):
            width = max(2, len(str(len(value) - 1)))
            for i, (layer, v) in enumerate(value.items()):
                out[f"layers/{key.removeprefix('layer_')}/{i:0{width}d}.{layer}"] = v
        else:
            out[f"train/{key}"] = value  # "step" becomes STEP_KEY
    return out


def flat_event(record: dict[str, Any]) -> dict[str, Any]:
    """An event as a marker `events/<kind>` = 1 and its scalar details `events/<kind>/<key>`."""
    kind = record["kind"]
    flat = {
        f"events/{kind}/{k}": v
        for k, v in record.items()
        if isinstance(v, int | float | str) and k not in ("kind", "time")
    }
    flat[f"events/{kind}"] = 1
    return flat


def flat_figures(record: dict[str, Any]) -> dict[str, Any]:
    """final.json's figures from the `finish` event: lists by rank as `<key>/rank<r>`."""
    out: dict[str, Any] = {}
    for key, value in record.items():
        if key in ("time", "kind"):
            continue
        if isinstance(value, list):
            out.update({f"{key.removesuffix('_by_rank')}/rank{r}": v for r, v in enumerate(value)})
        else:
            out[key] = value
    return out


def numbers(flat: dict[str, Any]) -> dict[str, float]:
    """The numeric values of a flat record (sinks that chart numbers only; bools count)."""
    return {k: float(v) for k, v in flat.items() if isinstance(v, int | float)}


class HeldRecords:
    """Flat records waiting for their step to be old enough that no rollback can abandon it."""

    def __init__(self) -> None:
        self.held: deque[dict[str, Any]] = deque()  # by step, ascending
        self.sent_steps = array("q")  # steps of the records sent, ascending

    def add(self, flat: dict[str, Any]) -> None:
        self.held.append(flat)

    def due(self, step: float) -> list[dict[str, Any]]:
        """The held records of steps up to `step`, oldest first, now counted as sent."""
        out = []
        while self.held and self.held[0][STEP_KEY] <= step:
            out.append(self.held.popleft())
            self.sent_steps.append(out[-1][STEP_KEY])
        return out

    def abandon_after(self, step: int) -> int:
        """Drop the held records after `step` (a rollback went back to it); returns how many
        records after it were already sent (a rollback deeper than the hold): the sinks keep
        those, and the replay's records of the same steps follow them."""
        self.held = deque(r for r in self.held if r[STEP_KEY] <= step)
        first = bisect_right(self.sent_steps, step)
        num_sent = len(self.sent_steps) - first
        del self.sent_steps[first:]  # the replay's records follow the kept ones: still ascending
        return num_sent
