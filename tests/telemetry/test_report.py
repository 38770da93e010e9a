import json
import math
from pathlib import Path

import pytest

from bigtrain.parallel.env import DistEnv
from bigtrain.runner import run
from bigtrain.store.rundir import read_jsonl
from bigtrain.telemetry.report import build_report
from bigtrain.telemetry.trajectory import split_trajectory
from tests.conftest import run_cli


@pytest.mark.e2e
def test_report_plots_what_metrics_jsonl_holds_with_anomaly_markers(micro):
    cfg = micro(
        "train.max_steps=20",
        "train.log_every=2",
        "resilience.snapshot_every=5",
        "resilience.confirm_steps=3",
        "drill.nan_grad_step=12",
    )
    run(cfg, DistEnv())
    out = Path(cfg.train.out_dir)
    result = run_cli("report", str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    report = out / "report"
    for name in ("loss", "grad_norm", "lr", "throughput", "layer_grad_norm"):
        assert (report / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    plotted = json.loads((report / "plotted.json").read_text())
    metrics = read_jsonl(out / "metrics.jsonl")
    kept, abandoned = split_trajectory(metrics)
    assert [[m["step"] for m in seg] for seg in abandoned] == [[6, 8, 10, 12]]  # rolled back to 5
    losses = [(m["step"], float(m["loss"])) for m in kept if "loss" in m]
    assert plotted["loss"]["loss"]["x"] == [float(s) for s, _ in losses]
    assert plotted["loss"]["loss"]["y"] == pytest.approx([v for _, v in losses], nan_ok=True)
    cut = [float(m["loss"]) for m in abandoned[0]]
    assert plotted["loss"]["loss abandoned 1"]["y"] == pytest.approx(cut, nan_ok=True)
    vals = [m["val_loss"] for m in kept if "val_loss" in m]
    assert plotted["loss"]["val_loss"]["y"] == pytest.approx(vals)
    assert plotted["loss"]["anomaly"]["x"] == [12.0, 12.0]  # a vertical marker at the anomaly
    assert plotted["loss"]["rollback"]["x"][0] == 12.0  # marked at the step it happened in
    rows = [m for m in kept if "layer_grad_norm" in m]
    heat = plotted["layer_grad_norm"]
    assert heat["steps"] == [m["step"] for m in rows]
    first = heat["log10_layer_grad_norm"]["array"][0]  # tok_emb across the kept logged steps
    assert heat["layers"][0] == "tok_emb"
    expected = [math.log10(float(m["layer_grad_norm"]["tok_emb"]) + 1e-30) for m in rows]
    assert first == pytest.approx(expected, nan_ok=True)
    page = (report / "index.html").read_text()
    assert "master weights" in page and "rollback" in page and 'src="loss.png"' in page


@pytest.mark.e2e
def test_report_on_a_directory_without_metrics_exits_2(tmp_path):
    result = run_cli("report", str(tmp_path))
    assert result.returncode == 2 and "no metrics.jsonl" in result.stderr


@pytest.mark.unit
def test_split_trajectory_cuts_each_replayed_stretch_into_its_own_segment():
    first, replay, resume = [10, 20, 30, 40, 50], [30, 40, 50, 60], [20, 30, 70]
    records = [
        {"step": s, "attempt": a} for a, steps in enumerate((first, replay, resume)) for s in steps
    ]
    kept, abandoned = split_trajectory(records)
    assert [(m["step"], m["attempt"]) for m in kept] == [(10, 0), (20, 2), (30, 2), (70, 2)]
    # The second cut goes back past the first replay: the first attempt's step 20 and the
    # replay's 30..60 were one stretch of the kept trajectory, so they are one segment.
    assert [[(m["step"], m["attempt"]) for m in seg] for seg in abandoned] == [
        [(30, 0), (40, 0), (50, 0)],
        [(20, 0), (30, 1), (40, 1), (50, 1), (60, 1)],
    ]
    assert split_trajectory([]) == ([], [])
    same = [{"step": 0, "val_loss": 9.0}, {"step": 5}, {"step": 5, "again": True}]
    assert split_trajectory(same) == ([same[0], same[2]], [[same[1]]])


# Logged steps 10..55, rolled back from 55 to 30, then 30..60 again.
KEPT_STEPS = [*range(10, 30, 5), *range(30, 65, 5)]  # 10..25 before the rollback, 30..60 after
ABANDONED_STEPS = list(range(30, 60, 5))  # the first 30..55


def _record(step: int, attempt: int, spike: tuple[int, int] | None) -> dict:
    """A metrics.jsonl record of a synthetic run; `attempt` 0 before the rollback, 1 after."""
    record = {
        "step": step,
        "loss": 146.0 if spike == (attempt, step) else 4.0 + 10 / step + 0.5 * attempt,
        "grad_norm": 1.0 + attempt,
        "lr": 1e-3 * (1 - step / 100),
        "tokens_per_s": 1000.0 + step + 100 * attempt,
        "mfu": 0.30 + step / 1000 + 0.1 * attempt,
        "layer_grad_norm": {"tok_emb": 0.1 * step + attempt, "blocks.0": 0.2},
    }
    if step % 20 == 0:
        record["val_loss"] = 4.5 + 0.5 * attempt
    return record


def _rolled_back_run(run_dir: Path, spike: tuple[int, int] | None) -> Path:
    """A run directory whose metrics.jsonl holds steps 10..55, then 30..60 after a rollback from
    55 to 30; `spike`: (attempt, step) whose loss is 146."""
    run_dir.mkdir()
    first = [_record(s, 0, spike) for s in range(10, 60, 5)]
    replay = [_record(s, 1, spike) for s in range(30, 65, 5)]
    lines = [json.dumps(m) for m in first + replay]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    events = [
        {"time": 0.0, "step": 0, "kind": "start", "precision": {}},
        {"time": 1.0, "step": 55, "kind": "anomaly", "type": "spike", "action": "rollback"},
        # As the trainer writes it: at the restored step.
        {"time": 1.0, "step": 55, "kind": "rollback", "from_step": 55, "to_step": 30},
    ]
    (run_dir / "events.jsonl").write_text("\n".join(json.dumps(e) for e in events) + "\n")
    build_report(run_dir)
    return run_dir


def _kept_attempt(step: int) -> int:
    return 0 if step < 30 else 1


@pytest.mark.unit
def test_report_draws_the_kept_trajectory_and_the_abandoned_segment_apart(tmp_path):
    run_dir = _rolled_back_run(tmp_path / "run", spike=(0, 55))
    plotted = json.loads((run_dir / "report" / "plotted.json").read_text())
    steps = [float(s) for s in KEPT_STEPS]
    loss = plotted["loss"]
    assert loss["loss"]["x"] == steps
    expected = [_record(s, _kept_attempt(s), None)["loss"] for s in KEPT_STEPS]
    assert loss["loss"]["y"] == pytest.approx(expected)
    assert loss["loss abandoned 1"]["x"] == [float(s) for s in ABANDONED_STEPS]
    assert loss["loss abandoned 1"]["y"][-1] == 146.0  # the spike that caused the rollback
    assert loss["val_loss"]["x"] == [20.0, 40.0, 60.0]
    assert loss["val_loss"]["y"] == pytest.approx([4.5, 5.0, 5.0])  # step 40 from the replay
    assert loss["val_loss abandoned 1"]["x"] == [40.0]
    assert "loss abandoned 2" not in loss
    legend = loss["_axes"][0]["legend"]
    assert legend.count("abandoned (rolled back)") == 1 and "loss" in legend
    assert loss["rollback"]["x"] == [55.0, 55.0] and loss["anomaly"]["x"] == [55.0, 55.0]
    for name, key in (("grad_norm", "grad_norm"), ("lr", "lr"), ("throughput", "tokens_per_s")):
        assert plotted[name][key]["x"] == steps, name
        assert plotted[name][f"{key} abandoned 1"]["x"] == [float(s) for s in ABANDONED_STEPS]
    heat = plotted["layer_grad_norm"]
    assert heat["steps"] == KEPT_STEPS
    tok_emb = [math.log10(0.1 * s + _kept_attempt(s)) for s in KEPT_STEPS]
    assert heat["log10_layer_grad_norm"]["array"][heat["layers"].index("tok_emb")] == (
        pytest.approx(tok_emb)
    )


@pytest.mark.unit
@pytest.mark.parametrize("spike", [(0, 55), (1, 45), None])  # (attempt, step) with loss 146
def test_report_clips_the_loss_axis_to_the_bulk_and_marks_a_spike_at_the_edge(tmp_path, spike):
    run_dir = _rolled_back_run(tmp_path / "run", spike=spike)
    loss = json.loads((run_dir / "report" / "plotted.json").read_text())["loss"]
    bottom, top = loss["_axes"][0]["ylim"]
    drawn = loss["loss"]["y"] + loss["loss abandoned 1"]["y"] + loss["val_loss"]["y"]
    bulk = [v for v in drawn if v != 146.0]
    assert bottom <= min(bulk) and max(bulk) <= top < 6.0  # the bulk fills the axis
    marked = loss.get("loss off the scale (value above)")
    if spike is None:
        assert marked is None and max(drawn) < 6.0
    else:
        assert 146.0 in drawn  # the lines keep the true value; the axis stops below it
        assert marked == {"x": [float(spike[1])], "y": [top]}  # at the top edge, at its step
        assert "off the scale (value above)" in loss["_axes"][0]["legend"]


@pytest.mark.unit
def test_report_throughput_shows_tokens_per_s_and_mfu_on_labelled_axes(tmp_path):
    run_dir = _rolled_back_run(tmp_path / "run", spike=None)
    plotted = json.loads((run_dir / "report" / "plotted.json").read_text())["throughput"]
    tokens_axes, mfu_axes = plotted["_axes"]
    assert tokens_axes["ylabel"] == "tokens/s" and "tokens_per_s" in tokens_axes["legend"]
    assert mfu_axes["ylabel"] == "MFU (% of peak FLOP/s)" and "mfu" in mfu_axes["legend"]
    assert mfu_axes["xlabel"] == "step"
    assert plotted["mfu"]["x"] == [float(s) for s in KEPT_STEPS]
    expected = [_record(s, _kept_attempt(s), None)["mfu"] for s in KEPT_STEPS]
    assert plotted["mfu"]["y"] == pytest.approx(expected)  # stored as a fraction


@pytest.mark.unit
def test_an_anomaly_and_the_rollback_it_caused_both_show_at_one_step():
    """They share a step (the trainer writes both there): neither marker may hide the other."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from bigtrain.telemetry.report import _mark_events

    fig = Figure(figsize=(4, 3), dpi=100)
    ax = fig.subplots()
    ax.set_xlim(0, 100)
    _mark_events(ax, [{"step": 55, "kind": "anomaly"}, {"step": 55, "kind": "rollback"}])
    ax.set_axis_off()  # only the markers are drawn
    FigureCanvasAgg(fig).draw()
    rgb = np.asarray(fig.canvas.buffer_rgba())[..., :3].astype(int)
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    red = (r > 200) & (g < 80) & (b < 80)
    purple = (r > 100) & (b > 100) & (abs(r - b) < 40) & (g < r - 25)
    assert red.sum() > 50 and purple.sum() > 50, (red.sum(), purple.sum())
    labels = [line.get_label() for line in ax.get_lines()]
    assert sorted(labels) == ["anomaly", "rollback"]  # one legend entry each
