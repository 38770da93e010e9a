"""`bigtrain report RUN_DIR`: PNG plots and one HTML page from a run directory.

Reads metrics.jsonl, events.jsonl and the start event's precision policy; writes RUN_DIR/report/
with loss.png (training and validation loss, anomalies and rollbacks marked), grad_norm.png, lr.png,
loss_scale.png (with loss scaling), throughput.png (tokens/s and MFU), layer_grad_norm.png (a layer x
step heatmap), index.html, and plotted.json: every plotted series as read back from the figures, so
what the plots show can be checked against metrics.jsonl.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

import numpy as np

from bigtrain.errors import ConfigError
from bigtrain.observe.rundir import read_jsonl

MARKED_EVENTS = ("anomaly", "rollback", "preempt", "abort")


def _num(value: Any) -> float | None:
    """A metric value as a float; metrics.jsonl writes NaN/Inf as the strings 'nan'/'inf'."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return None
    try:
        return float(value)
    except ValueError:
        return None


def _series(metrics: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    rows = [(m["step"], _num(m.get(key))) for m in metrics]
    rows = [(s, v) for s, v in rows if v is not None]
    return [s for s, _ in rows], [v for _, v in rows]


def _plotted(fig) -> dict[str, dict[str, list]]:
    """Every line and image of a figure, as data (what the PNG shows)."""
    out: dict[str, dict[str, list]] = {}
    for ax in fig.axes:
        for line in ax.get_lines():
            label = line.get_label()
            if not label.startswith("_"):
                out[label] = {
                    "x": [float(x) for x in line.get_xdata()],
                    "y": [float(y) for y in line.get_ydata()],
                }
        for image in ax.get_images():
            data = np.ma.filled(np.ma.asarray(image.get_array(), dtype=float), np.nan)
            out[image.get_label() or "image"] = {"array": data.tolist()}
    return out


def build_report(run_dir: Path) -> Path:
    """Write the report; returns the HTML page's path. ConfigError for a directory without
    metrics."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics_file = run_dir / "metrics.jsonl"
    if not metrics_file.is_file():
        raise ConfigError(f"'{run_dir}' is not a run directory: no metrics.jsonl")
    metrics = [m for m in read_jsonl(metrics_file) if "step" in m]
    events = read_jsonl(run_dir / "events.jsonl") if (run_dir / "events.jsonl").is_file() else []
    out = run_dir / "report"
    out.mkdir(exist_ok=True)
    plotted: dict[str, dict] = {}
    images: list[str] = []

    def save(fig, name: str, title: str) -> None:
        fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=100)
        plotted[name] = _plotted(fig)
        images.append(name)
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4))
    for key in ("loss", "val_loss"):
        steps, values = _series(metrics, key)
        if steps:
            ax.plot(steps, values, label=key, marker="o" if key == "val_loss" else None)
    for kind, color in (("anomaly", "red"), ("rollback", "purple"), ("preempt", "orange")):
        steps = [e["step"] for e in events if e["kind"] == kind]
        for i, step in enumerate(steps):
            ax.axvline(step, color=color, linestyle="--", label=kind if i == 0 else "_" + kind)
    ax.set_xlabel("step")
    ax.legend()
    save(fig, "loss", "loss")

    for key, title in (("grad_norm", "gradient norm (before clipping)"), ("lr", "learning rate")):
        steps, values = _series(metrics, key)
        fig, ax = plt.subplots(figsize=(8, 3))
        ax.plot(steps, values, label=key)
        ax.set_xlabel("step")
        if key == "grad_norm":
            ax.set_yscale("log")
        save(fig, key, title)

    steps, values = _series(metrics, "loss_scale")
    if steps:
        fig, ax = plt.subplots(figsize=(8, 3))
        ax.plot(steps, values, label="loss_scale")
        ax.set_yscale("log", base=2)
        save(fig, "loss_scale", "FP16 loss scale")

    fig, ax = plt.subplots(figsize=(8, 3))
    steps, values = _series(metrics, "tokens_per_s")
    ax.plot(steps, values, label="tokens_per_s")
    ax.set_xlabel("step")
    steps, values = _series(metrics, "mfu")
    if steps:
        twin = ax.twinx()
        twin.plot(steps, values, label="mfu", color="green")
    save(fig, "throughput", "throughput (tokens/s) and MFU")

    rows = [m for m in metrics if isinstance(m.get("layer_grad_norm"), dict)]
    if rows:
        layers = list(rows[-1]["layer_grad_norm"])
        grid = [[_num(m["layer_grad_norm"].get(layer, "nan")) for m in rows] for layer in layers]
        fig, ax = plt.subplots(figsize=(8, 0.4 * len(layers) + 1.5))
        image = ax.imshow(np.log10(np.asarray(grid) + 1e-30), aspect="auto", cmap="viridis")
        image.set_label("log10_layer_grad_norm")
        ax.set_yticks(range(len(layers)), layers)
        ticks = list(range(0, len(rows), max(1, len(rows) // 8)))
        ax.set_xticks(ticks, [str(rows[i]["step"]) for i in ticks])
        ax.set_xlabel("step")
        fig.colorbar(image, ax=ax, label="log10 gradient norm")
        save(fig, "layer_grad_norm", "per-layer gradient norm")
        plotted["layer_grad_norm"]["layers"] = layers
        plotted["layer_grad_norm"]["steps"] = [m["step"] for m in rows]

    (out / "plotted.json").write_text(json.dumps(plotted))
    page = out / "index.html"
    page.write_text(_html(run_dir, events, images))
    return page


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
