"""A micro MoE run end to end: the router metrics in metrics.jsonl and their flat sink keys, the
report's expert-load plot, `generate` and `export --hf --check` on its checkpoint; and
configs/moe-tiny.yaml as shipped."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from bigtrain.config import load_config
from bigtrain.model.hf_mapping import mapping_for
from bigtrain.parallel.env import DistEnv
from bigtrain.plan.shapes import meta_model
from bigtrain.runner import run
from bigtrain.store.rundir import read_jsonl
from bigtrain.telemetry.sinks import flat_record
from tests.conftest import ROOT, run_cli

pytestmark = pytest.mark.e2e

MOE = (
    "model.position=rope",
    "model.norm=rmsnorm",
    "model.mlp=swiglu",
    "model.bias=false",
    "model.moe.experts=4",
    "model.moe.top_k=2",
)


def test_a_micro_moe_run_logs_routers_plots_them_generates_and_exports(micro, tmp_path):
    cfg = micro(*MOE)
    final = run(cfg, DistEnv())
    assert final["anomalies"] == 0 and final["step"] == 20
    out = Path(cfg.train.out_dir)
    metrics = [m for m in read_jsonl(out / "metrics.jsonl") if "moe_load_max_mean" in m]
    assert [m["step"] for m in metrics] == [5, 10, 15, 20]
    last = metrics[-1]
    assert set(last["moe_layer_load"]) == {"blocks.0", "blocks.1"}
    shares = last["moe_layer_load"]["blocks.1"]
    assert len(shares) == 4 and sum(shares) == pytest.approx(1.0, abs=1e-3)
    assert last["moe_layer_load_max_mean"]["blocks.1"] == pytest.approx(4 * max(shares), rel=1e-3)
    assert 1.0 <= last["moe_load_max_mean"] <= 2.0  # top 2 of 4: at most 4 / 2
    # top-k picks the most probable experts, so the balancing loss sits near 1 or above
    assert 0.0 < last["moe_load_entropy"] <= 1.0 and last["moe_aux_loss"] > 0.9
    assert last["moe_dropped"] == 0  # dropless
    flat = flat_record(last)
    assert flat["moe/load/blocks.1/expert3"] == shares[3]
    assert "layers/moe_layer_load_max_mean/01.blocks.1" in flat
    report = run_cli("report", str(out))
    assert report.returncode == 0, report.stderr[-2000:]
    plotted = json.loads((out / "report" / "plotted.json").read_text())
    line = plotted["expert_load"]["blocks.1"]
    assert line["x"] == [5.0, 10.0, 15.0, 20.0]
    expected = [m["moe_layer_load_max_mean"]["blocks.1"] for m in metrics]
    assert line["y"] == pytest.approx(expected)
    generated = run_cli(
        "generate", str(out), "--prompt", "ROMEO:", "--max-new-tokens", "8", "--json"
    )
    assert generated.returncode == 0, generated.stderr[-2000:]
    assert json.loads(generated.stdout.strip().splitlines()[-1])
    exported = run_cli("export", str(out), "--hf", str(tmp_path / "hf"), "--check")
    assert exported.returncode == 0, exported.stderr[-2000:]
    result = json.loads(exported.stdout.strip().splitlines()[-1])
    assert result["architecture"] == "MixtralForCausalLM" and result["check"]["ok"]


def test_the_shipped_moe_configs_load_plan_and_export():
    cfg = load_config([str(ROOT / "configs" / "moe-tiny.yaml")], [])
    assert (cfg.model.moe.experts, cfg.model.moe.top_k, cfg.model.moe.first) == (8, 2, 0)
    # Showcased, so exportable: every block MoE, as Mixtral's layout has it.
    model = dataclasses.replace(cfg.model, vocab_size=cfg.data.vocab_size)
    shapes = {n: tuple(p.shape) for n, p in meta_model(cfg.model, cfg.data).named_parameters()}
    assert mapping_for(model, shapes).architecture == "MixtralForCausalLM"
    planned = run_cli(
        "plan",
        "configs/moe-tiny.yaml",
        "--world-size",
        "2",
        "parallel.backend=fsdp",
        "parallel.expert_parallel=2",
    )
    assert planned.returncode == 0, planned.stderr
    assert "4 experts of each MoE block (expert_parallel 2)" in planned.stdout
