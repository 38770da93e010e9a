"""End to end through the installed CLI on configs/tiny.yaml (the embedded Shakespeare corpus)."""

import json
import shutil

import pytest

from bigtrain.store.rundir import read_jsonl
from tests.conftest import run_cli


@pytest.mark.e2e
def test_tiny_config_trains_end_to_end(tmp_path, cache_dir):
    exe = shutil.which("bigtrain")
    assert exe is not None, "the bigtrain console script is not installed (pip install -e .)"
    out = tmp_path / "tiny"
    result = run_cli(
        "train",
        "configs/tiny.yaml",
        f"train.out_dir={out}",
        f"data.cache_dir={cache_dir}",
        "train.max_steps=30",
        "train.eval_every=15",
        "checkpoint.every=15",
        "wandb.mode=offline",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    final = json.loads((out / "final.json").read_text())
    assert final["step"] == 30 and final["tokens"] == 30 * 16 * 128
    assert final["anomalies"] == 0  # the warm-up spike rule stays quiet on a healthy run
    assert json.loads(result.stdout.strip().splitlines()[-1]) == final
    vals = [m["val_loss"] for m in read_jsonl(out / "metrics.jsonl") if "val_loss" in m]
    assert len(vals) == 3 and vals[-1] < vals[0] - 1.0
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "step_00000015",
        "step_00000030",
    ]
    assert (out / "config.yaml").read_text().count("source: shakespeare") == 1
    assert list((out / "wandb").glob("offline-run-*"))
    kinds = [e["kind"] for e in read_jsonl(out / "events.jsonl")]
    assert kinds[0] == "start" and kinds[-1] == "finish"
    assert (
        "compute             bf16" in result.stdout or "compute             fp32" in result.stdout
    )
    # A console for people: formatted lines, no Python reprs; stdout ends with final.json's line.
    console = result.stdout.strip().splitlines()[:-1] + result.stderr.strip().splitlines()
    reprs = [line for line in console if "{" in line or "}" in line or "': " in line]
    assert reprs == [], reprs
    assert f"checkpoint step 15 -> {out / 'checkpoints' / 'step_00000015'} (" in result.stderr
    step_lines = [line for line in console if line.startswith("step ")]
    assert (
        step_lines[-1].startswith("step 30/30  loss ") and "elapsed  eta 0:00:00" in step_lines[-1]
    )
    assert not [line for line in console if ".tmp-" in line]
