"""The MLflow sink (`pip install bigtrain[mlflow]`): no server needed. The tracking store is
MLFLOW_TRACKING_URI when set (a server, a database, a folder), else a SQLite file in the run
directory, sqlite:///RUN_DIR/mlflow.db; a SQLite store's new experiment keeps its artifacts
beside the database (RUN_DIR/mlartifacts).

Metrics by the training step (the same keys as wandb's); events as marker metrics `events/<kind>`
= 1 with their numeric details, and RUN_DIR/events.jsonl as an artifact when the process ends; the
resolved config as params (dotted keys) and the precision policy as params `policy.<component>`;
text samples as artifacts `samples/step_<step>.txt`; final.json's figures as metrics `final/<key>`
at the last step (strings, such as the fingerprint, as tags `final.<key>`). A restarted run
continues the same MLflow run (RUN_DIR/mlflow_run_id); params whose value changed since are
kept and the new value is a tag `changed.<key>` (MLflow refuses to change a param)."""

from __future__ import annotations

import json
import os
import time
from collections import deque
from pathlib import Path
from typing import Any

from bigtrain.config.load import flatten
from bigtrain.telemetry.sinks import SinkRun, numbers

RUN_ID_FILE = "mlflow_run_id"
MAX_PARAM_CHARS = 6000  # MLflow's limit on a param value
BATCH = 100  # params per log_batch (MLflow's limit)


def tracking_uri(run_dir: Path) -> str:
    """MLFLOW_TRACKING_URI, else a SQLite store in the run directory."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{run_dir.resolve() / 'mlflow.db'}"


def artifact_root(uri: str) -> str | None:
    """Artifacts of a new experiment in a SQLite store go beside the database file (MLflow's
    default, ./mlruns, depends on the working directory); elsewhere the store decides."""
    if not uri.startswith("sqlite:///"):
        return None
    return (Path(uri.removeprefix("sqlite:///")).parent / "mlartifacts").resolve().as_uri()


def param_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text[:MAX_PARAM_CHARS]


MAX_QUEUED = 64  # batches in MLflow's logging queue before the oldest is waited for


class MlflowSink:
    name = "mlflow"

    def __init__(self, experiment: str) -> None:
        self.experiment = experiment
        self.client = None
        self.run_id: str | None = None
        self.step = 0
        self.events_file: Path | None = None  # RUN_DIR/events.jsonl: an artifact at close
        self.queued: deque = deque()  # MLflow's RunOperations of metrics not yet known stored

    def start(self, run: SinkRun) -> None:
        from mlflow.tracking import MlflowClient

        uri = tracking_uri(run.path)
        self.client = MlflowClient(tracking_uri=uri, registry_uri=uri)
        self.step, self.events_file = run.start_step, run.path / "events.jsonl"
        self.run_id = self._open_run(run, uri)
        params = {k: param_value(v) for k, v in flatten(run.config).items()}
        params.update({f"policy.{k}": v["choice"] for k, v in run.policy.items()})
        self._log_params(params)

    def _open_run(self, run: SinkRun, uri: str) -> str:
        from mlflow.exceptions import MlflowException

        id_file = run.path / RUN_ID_FILE
        if id_file.is_file():
            try:
                run_id = id_file.read_text().strip()
                self.client.update_run(run_id, status="RUNNING")
                return run_id
            except MlflowException:  # another store (MLFLOW_TRACKING_URI changed): a new run
                pass
        found = self.client.get_experiment_by_name(self.experiment)
        if found is not None:
            experiment_id = found.experiment_id
        else:
            experiment_id = self.client.create_experiment(self.experiment, artifact_root(uri))
        created = self.client.create_run(experiment_id, run_name=run.name)
        id_file.write_text(created.info.run_id + "\n")
        return created.info.run_id

    def _log_params(self, params: dict[str, str]) -> None:
        """Params not yet logged; a changed value becomes a `changed.<key>` tag."""
        from mlflow.entities import Param

        logged = self.client.get_run(self.run_id).data.params
        for key in (k for k in params if k in logged and logged[k] != params[k]):
            self.client.set_tag(self.run_id, f"changed.{key}", params[key][:5000])
        new = [Param(k, v) for k, v in params.items() if k not in logged]
        for i in range(0, len(new), BATCH):
            self.client.log_batch(self.run_id, params=new[i : i + BATCH])

    def _log_metrics(self, values: dict[str, float], step: int) -> None:
        """Queued to MLflow's logging thread: a SQLite store takes about 0.7 ms per metric
        (bench/sinks.py), which the training thread would otherwise wait for."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):  # MLflow takes up to 1000 metrics per batch
            batch = metrics[i : i + 1000]
            self.queued.append(self.client.log_batch(self.run_id, metrics=batch, synchronous=False))
        self._wait(keep=MAX_QUEUED)  # bounded: memory, and a storage error seen within a few logs

    def _wait(self, keep: int = 0) -> None:
        """Until at most `keep` queued batches are not yet known stored, oldest first (an error
        in storing one is raised here)."""
        while len(self.queued) > keep:
            self.queued.popleft().wait()

    def log_record(self, step: int, flat: dict[str, Any]) -> None:
        self._log_metrics(numbers(flat), step)
        self.step = max(self.step, step)

    def log_event(self, step: int, record: dict[str, Any], flat: dict[str, Any]) -> None:
        self._log_metrics(numbers(flat), step)

    def log_samples(self, step: int, samples: list) -> None:
        text = "\n-----\n".join(s.prompt + s.text for s in samples)
        self.client.log_text(self.run_id, text, f"samples/step_{step:08d}.txt")

    def log_summary(self, figures: dict[str, Any]) -> None:
        self._log_metrics(
            {f"final/{k}": v for k, v in numbers(figures).items()}, figures.get("step", self.step)
        )
        for key, value in figures.items():
            if isinstance(value, str):
                self.client.set_tag(self.run_id, f"final.{key}", value)

    def close(self) -> None:
        if self.run_id is None:
            return
        self._wait()
        if self.events_file is not None and self.events_file.is_file():  # the whole run's log
            self.client.log_artifact(self.run_id, str(self.events_file))
        self.client.set_terminated(self.run_id)
        self.run_id = None
