"""Checkpoints of an earlier bigtrain version (manifest format 1, each backend's own layout:
tests/checkpoint/legacy/, written by make.py at commit 988d144) are refused by the load path
with the command that converts them; converted once, each resumes on the backend and world size
that wrote it to the weights and losses of that version's own straight run.

Those reference numbers were recorded on one machine (make.py); floating-point results differ
between CPUs, so they are compared within a tolerance, measured (docs/development.md): the
weights at step 6 of a step-3 checkpoint made on an AMD EPYC, resumed on an Intel Xeon, differ
from the Intel straight run's by 4.5e-7 (relative L2 over every parameter; 2.6e-6 at most in one
value), while the smallest conversion fault tried (second moments off by 1%) moves them by
2.0e-4, a missed step count by 4.5e-3, zeroed first moments by 4.4e-2, a data cursor one
micro-batch off by 2.5e-2. TOLERANCE sits between, a factor 20 from each side."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from bigtrain.checkpoint.convert import convert
from bigtrain.checkpoint.manifest import CheckpointError, verify
from bigtrain.checkpoint.state import CheckpointReader
from bigtrain.config import load_config
from bigtrain.parallel.env import read_env
from bigtrain.runner import run
from bigtrain.store.rundir import read_jsonl
from tests.conftest import micro_overrides
from tests.distributed import run_distributed

pytestmark = pytest.mark.distributed

LEGACY = Path(__file__).parent / "legacy"
EXPECTED = json.loads((LEGACY / "expected.json").read_text())
TOLERANCE = 1e-5  # relative L2 of the weights (module docstring); losses likewise
SMALL = ["model.n_layers=1", "model.d_model=32", "train.global_batch_size=16", "train.max_steps=6"]
SMALL += ["checkpoint.every=3", "checkpoint.async_save=false", "train.log_every=1"]
SMALL += ["train.eval_every=0", "precision.compute_dtype=fp32"]
BACKENDS = {
    "local": ["parallel.backend=local"],
    "fsdp": ["parallel.backend=fsdp"],
    "zero2": ["parallel.backend=zero", "parallel.zero_stage=2"],
}


def train(overrides: list[str]) -> dict:
    cfg = load_config([], overrides)
    final = run(cfg, read_env())
    metrics = read_jsonl(Path(cfg.train.out_dir) / "metrics.jsonl")
    return {
        "fingerprint": final["fingerprint"],
        "losses": {m["step"]: m["loss"] for m in metrics if "loss" in m},
    }


def relative_l2(weights: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """||w - ref|| / ||ref|| over every parameter of `weights` (the reference may hold more:
    an untied copy the old fsdp consolidation wrote)."""
    num = sum((w.double() - reference[n].double()).square().sum() for n, w in weights.items())
    den = sum(reference[n].double().square().sum() for n in weights)
    return float((num / den) ** 0.5)


def launch(name: str, args: list[str]):
    return train(args) if name == "local" else run_distributed(train, 2, args)[0]


@pytest.mark.parametrize("name", list(BACKENDS))
def test_a_converted_checkpoint_resumes_the_old_versions_run(
    name, tmp_path, corpus_files, cache_dir
):
    args = [*micro_overrides(tmp_path / "run", corpus_files, cache_dir), *SMALL, *BACKENDS[name]]
    old = tmp_path / "old"
    shutil.copytree(LEGACY / name, old)  # resume never writes into it, but keep the repo clean
    local = [*micro_overrides(tmp_path / "refused", corpus_files, cache_dir), *SMALL]
    with pytest.raises(CheckpointError, match=f"convert it once with `bigtrain ckpt convert {old}"):
        train([*local, f"checkpoint.resume={old}"])  # in this process: no process group
    manifest = convert(old, tmp_path / "converted")
    assert manifest["format_version"] == 2 and manifest["step"] == 3
    assert manifest["converted_from"]["format_version"] == 1
    assert (
        verify(tmp_path / "converted")["backend"]
        == json.loads((old / "manifest.json").read_text())["backend"]
    )
    with pytest.raises(Exception, match="exists already"):
        convert(old, tmp_path / "converted")
    # the corpus is the same text at other paths (its key names them): allowed, and reported
    resume = [f"checkpoint.resume={tmp_path / 'converted'}", "checkpoint.allow_config_change=true"]
    resumed = launch(name, [*args, *resume])
    expected = EXPECTED[name]
    for step in (4, 5, 6):  # weights, moments, step counts, RNG and data cursor: the same losses
        want = expected["losses"][str(step)]
        assert resumed["losses"][step] == pytest.approx(want, rel=TOLERANCE), step
    reader = CheckpointReader(tmp_path / "run" / "checkpoints" / "step_00000006")
    weights = {n: reader.full(n) for n in reader.shapes}
    reference = load_file(LEGACY / f"final_{name}.safetensors")
    assert relative_l2(weights, reference) < TOLERANCE


def test_convert_renames_an_int8_calibration_of_the_fused_layers(tmp_path):
    """The calibration travels in trainer.json by layer name: q, k and v take the fused qkv's,
    a SwiGLU gate the fused up's (checked by the callback's own load afterwards)."""
    from bigtrain.checkpoint.convert import trainer_state

    amax = {"blocks.0.attn.qkv": [1.0], "blocks.0.mlp.up": [2.0], "blocks.0.mlp.down": [3.0]}
    saved = {"state": {"step": 3}, "callbacks": {"int8": {"steps": 3, "act_amax": amax}}}
    (tmp_path / "trainer.json").write_text(json.dumps(saved))

    class Today:  # the unfused source's names
        shapes = {f"blocks.0.{n}.weight": (4, 4) for n in ("attn.q", "attn.k", "attn.v")}
        shapes |= {f"blocks.0.mlp.{n}.weight": (4, 4) for n in ("gate", "up", "down")}

    converted = trainer_state(tmp_path, Today())["callbacks"]["int8"]
    assert converted["act_amax"] == {
        "blocks.0.attn.q": [1.0],
        "blocks.0.attn.k": [1.0],
        "blocks.0.attn.v": [1.0],
        "blocks.0.mlp.gate": [2.0],
        "blocks.0.mlp.up": [2.0],
        "blocks.0.mlp.down": [3.0],
    }
    assert converted["steps"] == 3
