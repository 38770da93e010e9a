import json
import math
from pathlib import Path

import pytest

from bigtrain.build import run
from bigtrain.observe.rundir import read_jsonl
from bigtrain.parallel.env import DistEnv
from tests.conftest import run_cli


def test_report_plots_what_metrics_jsonl_holds_with_anomaly_markers(micro):
    cfg = micro(
        "train.max_steps=20",
        "train.log_every=2",
        "resilience.snapshot_every=5",
        "resilience.confirm_steps=3",
        "fault.nan_grad_step=12",
    )
    run(cfg, DistEnv(), log=lambda *_: None)
    out = Path(cfg.train.out_dir)
    result = run_cli("report", str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    report = out / "report"
    for name in ("loss", "grad_norm", "lr", "throughput", "layer_grad_norm"):
        assert (report / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    plotted = json.loads((report / "plotted.json").read_text())
    metrics = read_jsonl(out / "metrics.jsonl")
    losses = [(m["step"], float(m["loss"])) for m in metrics if "loss" in m]
    assert plotted["loss"]["loss"]["x"] == [float(s) for s, _ in losses]
    assert plotted["loss"]["loss"]["y"] == pytest.approx([v for _, v in losses], nan_ok=True)
    vals = [m["val_loss"] for m in metrics if "val_loss" in m]
    assert plotted["loss"]["val_loss"]["y"] == pytest.approx(vals)
    assert plotted["loss"]["anomaly"]["x"] == [12.0, 12.0]  # a vertical marker at the anomaly
    assert plotted["loss"]["rollback"]["x"][0] == 5.0  # the rollback event sits at its target
    rows = [m for m in metrics if "layer_grad_norm" in m]
    heat = plotted["layer_grad_norm"]
    assert heat["steps"] == [m["step"] for m in rows]
    first = heat["log10_layer_grad_norm"]["array"][0]  # tok_emb across the logged steps
    assert heat["layers"][0] == "tok_emb"
    expected = [math.log10(float(m["layer_grad_norm"]["tok_emb"]) + 1e-30) for m in rows]
    assert first == pytest.approx(expected, nan_ok=True)
    page = (report / "index.html").read_text()
    assert "master weights" in page and "rollback" in page and 'src="loss.png"' in page


def test_report_on_a_directory_without_metrics_exits_2(tmp_path):
    result = run_cli("report", str(tmp_path))
    assert result.returncode == 2 and "no metrics.jsonl" in result.stderr
