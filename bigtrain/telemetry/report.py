"""`bigtrain report RUN_DIR`: PNG plots and one HTML page from a run directory.

Reads metrics.jsonl, events.jsonl and the start event's precision policy; writes RUN_DIR/report/
with loss.png (training and validation loss, anomalies, rollbacks and preemptions marked),
grad_norm.png, lr.png, loss_scale.png (with loss scaling), throughput.png (tokens/s above, MFU
below, on a shared step axis), layer_grad_norm.png (a layer x step heatmap), index.html, and
plotted.json.

Rollbacks and resumes from older checkpoints log steps again (see trajectory.py): every line shows
the trajectory the run kept, strictly increasing in step; each abandoned segment is drawn apart
(grey, dashed, faint, one legend entry "abandoned (rolled back)"), never joined to it. The
heatmap shows the kept steps only.

Loss axis: one spike (146 among losses near 4) would squeeze the curve into a flat line. A value
is an outlier when it exceeds SPIKE_FACTOR x the median of every loss drawn (kept or abandoned,
training or validation); the median is not moved by a few spikes, as a mean or a high percentile
of a short run would be. With outliers the y axis is clipped to the other values, so the bulk
fills the plot, and each outlier is a red triangle at the top edge with its value written above
it. (A log axis was the alternative: it still leaves losses between 4 and 5 in a sixteenth of the
height.)

plotted.json: for each plot, every line read back from the figure as {"x": [...], "y": [...]}
under its label (a metric's name, or a marker's event kind), each abandoned segment under
"<metric> abandoned <n>" (n counts the segments from 1, as split_trajectory returns them, so
"loss abandoned 2" and "val_loss abandoned 2" are one segment), outlier marks under
"loss off the scale (value above)", images as {"array": ...}, and "_axes": the x label, y label, y
scale, y limits and legend entries of each axes. Values are as metrics.jsonl stores them (MFU a
fraction; its axis shows percent), so the plots can be checked against it.
"""

from __future__ import annotations

import html
import json
import math
import statistics
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import PercentFormatter

from bigtrain.errors import ConfigError
from bigtrain.monitor.routers import LAYER_LOAD, LAYER_LOAD_MAX_MEAN
from bigtrain.store.rundir import read_jsonl
from bigtrain.telemetry.costs import time_lost, time_lost_table
from bigtrain.telemetry.ft_report import failures, failures_html, quorum_series
from bigtrain.telemetry.trajectory import split_trajectory

# Vertical markers by event kind, drawn in this order. A rollback happens at its anomaly's step:
# it is a wide faint band below, the anomaly a thin dashed line on top, so both show.
EVENT_MARKERS: dict[str, dict[str, Any]] = {
    "rollback": {"color": "purple", "linestyle": "-", "linewidth": 6, "alpha": 0.3, "zorder": 1},
    "preempt": {"color": "orange", "linestyle": ":", "linewidth": 1.5, "zorder": 2.5},
    "anomaly": {"color": "red", "linestyle": "--", "linewidth": 1.2, "zorder": 3},
}
ABANDONED = "abandoned (rolled back)"
ABANDONED_STYLE = {"color": "grey", "linestyle": "--", "alpha": 0.5, "linewidth": 1}
SPIKE_FACTOR = 10.0  # a loss above SPIKE_FACTOR x the median is drawn at the edge
OUTLIERS = "off the scale (value above)"


@dataclass
class RunLogs:
    """A run directory's logs, metrics split by split_trajectory."""

    kept: list[dict[str, Any]]
    """metrics.jsonl records the run kept, strictly increasing in step."""
    abandoned: list[list[dict[str, Any]]]
    """Segments of records abandoned by a rollback or a resume, in the order they were cut."""
    events: list[dict[str, Any]]
    """events.jsonl, in file order."""


def read_run_logs(run_dir: Path) -> RunLogs:
    """ConfigError for a directory without metrics.jsonl."""
    metrics_file = run_dir / "metrics.jsonl"
    if not metrics_file.is_file():
        raise ConfigError(f"'{run_dir}' is not a run directory: no metrics.jsonl")
    kept, abandoned = split_trajectory([m for m in read_jsonl(metrics_file) if "step" in m])
    return RunLogs(kept, abandoned, read_jsonl(run_dir / "events.jsonl"))


def build_report(run_dir: Path) -> Path:
    """Write the report; returns the HTML page's path. ConfigError for a directory without
    metrics."""
    logs = read_run_logs(run_dir)
    out = run_dir / "report"
    out.mkdir(exist_ok=True)
    plotted: dict[str, dict] = {}
    for name, fig, extra in _figures(logs):
        fig.savefig(out / f"{name}.png", dpi=100)
        plotted[name] = {**_plotted(fig), **extra}
    (out / "plotted.json").write_text(json.dumps(plotted))
    # With replica groups each group logs its own start and steps: the table is group 0's.
    own = [e for e in logs.events if e.get("group", 0) == 0]
    lost = time_lost(own)  # None for a run of an older bigtrain
    if lost is not None:
        (out / "time_lost.json").write_text(json.dumps(lost))
    page = out / "index.html"
    text = _html(run_dir, logs.events, list(plotted))
    extra = _time_lost_html(lost) + failures_html(failures(logs.events))
    page.write_text(text.replace("</body>", extra + "</body>"))
    return page


def _time_lost_html(rows: dict[str, float] | None) -> str:
    """The time-lost table (telemetry/costs.py): productive step time and each loss, in
    seconds and as a fraction of the wall time."""
    if rows is None:
        return ""
    body = "".join(
        f"<tr><td>{name}</td><td>{seconds:.2f}</td><td>{fraction:.2%}</td><td>{text}</td></tr>"
        for name, seconds, fraction, text in time_lost_table(rows)
    )
    return (
        f"<h2>time lost (wall {rows['wall']:.1f} s)</h2><table><tr><th>where</th><th>s</th>"
        f"<th>of wall</th><th></th></tr>{body}</table>"
    )


def _figures(logs: RunLogs) -> Iterator[tuple[str, Figure, dict[str, Any]]]:
    """(name, figure, extra data for plotted.json) of each plot, in the page's order."""
    yield "loss", _loss_figure(logs), {}
    title = "gradient norm (before clipping)"
    yield "grad_norm", _series_figure(logs, "grad_norm", title, "log"), {}
    yield "lr", _series_figure(logs, "lr", "learning rate"), {}
    if _series(logs.kept, "loss_scale")[0]:
        yield "loss_scale", _series_figure(logs, "loss_scale", "FP16 loss scale", "log", base=2), {}
    yield "throughput", _throughput_figure(logs), {}
    layers, steps, grid = _layer_grid(logs.kept)
    if layers:
        extra = {"layers": layers, "steps": steps}
        yield "layer_grad_norm", _layer_figure(layers, steps, grid), extra
    rows = [m for m in logs.kept if isinstance(m.get(LAYER_LOAD_MAX_MEAN), dict)]
    if rows:  # an MoE model's routers (monitor/routers.py)
        yield "expert_load", _expert_load_figure(rows), {}
    steps, sizes = quorum_series(logs.events)
    if steps:  # replica groups (parallel/replicas/groups.py)
        yield "quorum", _quorum_figure(steps, sizes), {"failures": failures(logs.events)}


def _quorum_figure(steps: list[int], sizes: list[int]) -> Figure:
    """The replica groups taking part, from each membership change on."""
    fig = Figure(figsize=(8, 2.5))
    ax = fig.subplots()
    ax.step(steps, sizes, where="post", label="groups in the quorum")
    ax.set_xlabel("step")
    ax.set_ylabel("groups")
    ax.set_ylim(0, max(sizes) + 0.5)
    return _finish(fig, "replica groups taking part")


def _num(value: Any) -> float | None:
    """A metric value as a float; metrics.jsonl writes NaN/Inf as the strings 'nan'/'inf'."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return None
    try:
        return float(value)
    except ValueError:
        return None


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    rows = [(m["step"], _num(m.get(key))) for m in records]
    rows = [(s, v) for s, v in rows if v is not None]
    return [s for s, _ in rows], [v for _, v in rows]


def _draw(ax: Axes, logs: RunLogs, key: str, **style: Any) -> None:
    """`key` of the kept records as the main line, each abandoned segment as its own faint line
    (one legend entry per axes for all of them)."""
    steps, values = _series(logs.kept, key)
    if steps:
        ax.plot(steps, values, label=key, **style)
    for n, segment in enumerate(logs.abandoned, start=1):
        steps, values = _series(segment, key)
        if not steps:
            continue
        first = ABANDONED not in ax.get_legend_handles_labels()[1]
        line = ax.plot(
            steps,
            values,
            label=ABANDONED if first else "_" + ABANDONED,
            marker=style.get("marker"),
            **ABANDONED_STYLE,
        )[0]
        line.set_gid(f"{key} abandoned {n}")


def _mark_events(ax: Axes, events: list[dict[str, Any]]) -> None:
    for kind, style in EVENT_MARKERS.items():
        steps = [e["step"] for e in events if e["kind"] == kind]
        for i, step in enumerate(steps):
            ax.axvline(step, label=kind if i == 0 else "_" + kind, **style)


def _clip_to_bulk(ax: Axes, points: list[tuple[int, float]], key: str) -> None:
    """Clip the y axis to the values up to SPIKE_FACTOR x the median of `points` (step, value)
    and mark those above it at the top edge, each with its value (see the module's docstring).
    Nothing to do without outliers, or for a median <= 0, where the factor means nothing."""
    finite = [(s, v) for s, v in points if math.isfinite(v)]
    median = statistics.median(v for _, v in finite) if finite else 0.0
    if median <= 0:
        return
    bulk = [v for _, v in finite if v <= SPIKE_FACTOR * median]
    outliers = sorted((s, v) for s, v in finite if v > SPIKE_FACTOR * median)
    if not outliers:
        return
    margin = 0.05 * (max(bulk) - min(bulk)) or 0.05 * max(bulk)
    top = max(bulk) + margin
    ax.set_ylim(min(bulk) - margin, top)
    steps = [s for s, _ in outliers]
    line = ax.plot(steps, [top] * len(steps), "^", color="red", clip_on=False, label=OUTLIERS)
    line[0].set_gid(f"{key} {OUTLIERS}")
    for step, value in outliers:
        ax.annotate(
            f"{value:.4g}",
            (step, top),
            xytext=(0, 6),
            textcoords="offset points",
            ha="center",
            fontsize=8,
            color="red",
            annotation_clip=False,
        )


def _finish(fig: Figure, title: str) -> Figure:
    for ax in fig.axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def _loss_figure(logs: RunLogs) -> Figure:
    fig = Figure(figsize=(8, 4))
    ax = fig.subplots()
    _draw(ax, logs, "loss")
    _draw(ax, logs, "val_loss", marker="o")
    _mark_events(ax, logs.events)
    points = [
        point
        for records in (logs.kept, *logs.abandoned)
        for key in ("loss", "val_loss")
        for point in zip(*_series(records, key), strict=True)
    ]
    _clip_to_bulk(ax, points, "loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    return _finish(fig, "loss")


def _series_figure(
    logs: RunLogs, key: str, title: str, yscale: str = "linear", **scale: Any
) -> Figure:
    fig = Figure(figsize=(8, 3))
    ax = fig.subplots()
    _draw(ax, logs, key)
    ax.set_yscale(yscale, **scale)
    ax.set_xlabel("step")
    ax.set_ylabel(key)
    return _finish(fig, title)


def _throughput_figure(logs: RunLogs) -> Figure:
    """tokens/s above, MFU below (when logged), sharing the step axis."""
    num_axes = 2 if _series(logs.kept, "mfu")[0] else 1
    fig = Figure(figsize=(8, 2.5 * num_axes + 0.5))
    axes = fig.subplots(num_axes, 1, sharex=True, squeeze=False)[:, 0]
    _draw(axes[0], logs, "tokens_per_s")
    axes[0].set_ylabel("tokens/s")
    if num_axes == 2:
        _draw(axes[1], logs, "mfu", color="green")
        axes[1].set_ylabel("MFU (% of peak FLOP/s)")
        axes[1].yaxis.set_major_formatter(PercentFormatter(xmax=1.0))  # stored as a fraction
    axes[-1].set_xlabel("step")
    return _finish(fig, "throughput (tokens/s) and MFU")


def _layer_grid(kept: list[dict[str, Any]]) -> tuple[list[str], list[int], list[list[float]]]:
    """(layers, steps, norms[layer][step]) of the kept records with per-layer gradient norms."""
    rows = [m for m in kept if isinstance(m.get("layer_grad_norm"), dict)]
    if not rows:
        return [], [], []
    layers = list(rows[-1]["layer_grad_norm"])
    grid = [[_layer_norm(m, layer) for m in rows] for layer in layers]
    return layers, [m["step"] for m in rows], grid


def _layer_norm(record: dict[str, Any], layer: str) -> float:
    value = _num(record["layer_grad_norm"].get(layer))
    return math.nan if value is None else value


def _layer_figure(layers: list[str], steps: list[int], grid: list[list[float]]) -> Figure:
    fig = Figure(figsize=(8, 0.4 * len(layers) + 1.5))
    ax = fig.subplots()
    image = ax.imshow(np.log10(np.asarray(grid) + 1e-30), aspect="auto", cmap="viridis")
    image.set_label("log10_layer_grad_norm")
    ax.set_yticks(range(len(layers)), layers)
    ticks = list(range(0, len(steps), max(1, len(steps) // 8)))
    ax.set_xticks(ticks, [str(steps[i]) for i in ticks])
    ax.set_xlabel("step")
    fig.colorbar(image, ax=ax, label="log10 gradient norm")
    fig.suptitle("per-layer gradient norm")
    fig.tight_layout()
    return fig


def _expert_load_figure(rows: list[dict[str, Any]]) -> Figure:
    """Per MoE block, its busiest expert's share of the routed tokens over the mean share (1.0:
    balanced); each expert's share in the last record's busiest block below."""
    fig = Figure(figsize=(8, 5.5))
    top, bottom = fig.subplots(2, 1)
    steps = [m["step"] for m in rows]
    for block in rows[-1][LAYER_LOAD_MAX_MEAN]:
        values = [_num(m[LAYER_LOAD_MAX_MEAN].get(block)) for m in rows]
        top.plot(steps, [math.nan if v is None else v for v in values], label=block)
    top.axhline(1.0, color="gray", linestyle="--", linewidth=0.8)
    top.set_xlabel("step")
    top.set_ylabel("busiest / mean")
    top.legend(fontsize="small")
    last = rows[-1]
    block = max(last[LAYER_LOAD_MAX_MEAN], key=last[LAYER_LOAD_MAX_MEAN].get)
    shares = last.get(LAYER_LOAD, {}).get(block, [])
    bottom.bar(range(len(shares)), shares, label=f"{block} at step {last['step']}")
    bottom.set_xlabel("expert")
    bottom.set_ylabel("share of routed tokens")
    bottom.legend(fontsize="small")
    return _finish(fig, "expert load")


def _plotted(fig: Figure) -> dict[str, Any]:
    """Every line and image of a figure, as data (what the PNG shows), and each axes' labels."""
    out: dict[str, Any] = {"_axes": []}
    for ax in fig.axes:
        for line in ax.get_lines():
            key = line.get_gid() or line.get_label()
            if not key.startswith("_"):
                out[key] = {
                    "x": [float(x) for x in line.get_xdata()],
                    "y": [float(y) for y in line.get_ydata()],
                }
        for image in ax.get_images():
            data = np.ma.filled(np.ma.asarray(image.get_array(), dtype=float), np.nan)
            out[image.get_label() or "image"] = {"array": data.tolist()}
        legend = ax.get_legend()
        out["_axes"].append(
            {
                "xlabel": ax.get_xlabel(),
                "ylabel": ax.get_ylabel(),
                "yscale": ax.get_yscale(),
                "ylim": [float(y) for y in ax.get_ylim()],
                "legend": [t.get_text() for t in legend.get_texts()] if legend else [],
            }
        )
    return out


def _html(run_dir: Path, events: list[dict[str, Any]], images: list[str]) -> str:
    start = next((e for e in events if e["kind"] == "start"), {})
    precision = start.get("precision", {})
    rows = "".join(
        f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(str(v.get('choice', v)))}</td>"
        f"<td>{html.escape(str(v.get('reason', '')))}</td></tr>"
        if isinstance(v, dict)
        else f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(str(v))}</td><td></td></tr>"
        for k, v in precision.items()
    )
    timeline = "".join(
        f"<tr><td>{e['step']}</td><td>{html.escape(e['kind'])}</td><td>"
        + html.escape(
            json.dumps({k: v for k, v in e.items() if k not in ("time", "step", "kind")})[:300]
        )
        + "</td></tr>"
        for e in events
        if e["kind"] not in ("checkpoint_started",)
    )
    plots = "".join(f'<h2>{name}</h2><img src="{name}.png" alt="{name}">' for name in images)
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>bigtrain report: {html.escape(run_dir.name)}</title>"
        "<style>body{font-family:sans-serif;max-width:1000px;margin:auto}"
        "td{border-bottom:1px solid #ddd;padding:2px 8px;font-size:90%}</style></head><body>"
        f"<h1>bigtrain report: {html.escape(str(run_dir))}</h1>"
        f"<h2>precision policy</h2><table>{rows}</table>"
        f"{plots}<h2>events</h2><table><tr><th>step</th><th>kind</th><th>details</th></tr>"
        f"{timeline}</table></body></html>"
    )
