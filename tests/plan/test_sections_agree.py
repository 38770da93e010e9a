"""Every section of a plan that shows a GPU's state bytes, its checkpoint bytes or the step time
shows the same number, for every shipped config and parallel preset under every precision preset:
the memory table, the per-stage table, the largest micro-batch, the step line, a run's `oom` event
(planned_memory), the layout proposal's row of the config's own layout and `plan --goodput`'s
inputs (issue 49: the goodput plan ignored the 405B recipe's stages, `--propose`'s micro-batch
section counted the whole model)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from bigtrain.cli import main
from bigtrain.config import load_config
from bigtrain.config.load import CHOICES
from bigtrain.errors import ConfigError
from bigtrain.plan.footprint import PlannedRun, planned
from bigtrain.plan.goodput import config_inputs
from bigtrain.plan.stages import planned_memory
from bigtrain.plan.step_time import step_time
from bigtrain.plan.text import fmt_bytes, plan_text
from bigtrain.precision import Hardware, resolve_policy

ROOT = Path(__file__).resolve().parents[2]
GPU = Hardware("cuda", "an sm90 GPU (planned)", cuda_capability=(9, 0))
MEMORY = 80 * 2**30
PRESETS = CHOICES["precision.preset"]
# A parallel preset goes after a recipe (docs/configs.md); the transformers ones after a
# transformers model of that family (small: the plan builds it on the meta device).
HF_MODELS = {
    "tp2-hf-llama.yaml": "{model_type: llama, hidden_size: 256, intermediate_size: 512, "
    "num_hidden_layers: 4, num_attention_heads: 8, num_key_value_heads: 4}",
    "tp2-hf-gpt2.yaml": "{model_type: gpt2, n_embd: 64, n_layer: 2, n_head: 4}",
}
SIZES = {"llama-405b.yaml": 16384}  # a recipe at the size its docs plan it; the rest at 64


def shipped() -> list[tuple[list[str], list[str]]]:
    """(files, overrides) of every config under configs/ and configs/parallel/."""
    out = [([str(f)], []) for f in sorted((ROOT / "configs").glob("*.yaml"))]
    for f in sorted((ROOT / "configs/parallel").glob("*.yaml")):
        if f.name in HF_MODELS:
            hf = ["model.kind=hf", f"model.hf_config={HF_MODELS[f.name]}", "data.vocab_size=384"]
            out.append(([str(f)], hf))
        else:
            out.append(([str(ROOT / "configs/llama-7b.yaml"), str(f)], []))
    return out


CASES = shipped()


def at_preset(run: PlannedRun, files: list[str], overrides: list[str], preset: str):
    """`run` under precision.preset=`preset` (the same meta model; the policy resolved again as
    `planned` resolves it), or None where the policy refuses it (FP16 from 20B parameters)."""
    precision = load_config(files, [*overrides, f"precision.preset={preset}"]).precision
    try:
        policy = resolve_policy(precision, run.hardware, run.num_params)
    except ConfigError:
        return None
    return dataclasses.replace(
        run, cfg=dataclasses.replace(run.cfg, precision=precision), policy=policy
    )


def one(pattern: str, text: str) -> re.Match:
    found = re.findall(pattern, text, flags=re.MULTILINE)
    assert len(found) == 1, (pattern, found)
    return re.search(pattern, text, flags=re.MULTILINE)  # type: ignore[return-value]


def stage_rows(text: str) -> dict[int, dict[str, str]]:
    """The per-stage table: rank -> params and the four byte columns as printed."""
    rows = {}
    start = text.splitlines().index(next(x for x in text.splitlines() if x.startswith("pipeline:")))
    for line in text.splitlines()[start + 2 :]:
        if not line.strip():
            break
        p = line.split()
        rows[int(p[0])] = {
            "params": p[-10],
            "states": " ".join(p[-8:-6]),
            "transient": " ".join(p[-6:-4]),
            "total": " ".join(p[-2:]),
        }
    return rows


def sections(text: str) -> dict[str, str]:
    """The numbers each section prints (bytes as fmt_bytes writes them)."""
    fit = one(
        r"^largest .*?micro-batch .*?(?:pipeline rank (\d+) )?\(states (.+?), transient weights "
        r"and gradients (.+?), reserve",
        text,
    )
    out = {
        "table states": one(r"^  total +[\d.]+ B/param +(.+)$", text).group(1),
        "table checkpoint": one(r"^  checkpoint per GPU \(.*\) (.+)$", text).group(1),
        "step": one(r"^  ([\d.]+) s \(compute\+bubble", text).group(1),
        "fit rank": fit.group(1) or "0",
        "fit states": fit.group(2),
        "fit transient": fit.group(3),
    }
    transient = re.search(r"^  \+ transient: .*?\((.+?) with one block", text, flags=re.MULTILINE)
    if transient:
        out["table transient"] = transient.group(1)
    return out


@pytest.mark.unit
@pytest.mark.parametrize(
    ("files", "overrides"), CASES, ids=[c[0][-1].split("configs/")[1] for c in CASES]
)
def test_every_section_shows_the_same_states_checkpoint_and_step(files, overrides):
    cfg = load_config(files, overrides)
    world = SIZES.get(Path(files[0]).name, 64)
    base = planned(cfg, world, GPU)  # `bigtrain plan` (the global batch derived)
    # `plan --goodput` and `--propose` plan the same run where the global batch divides
    held = planned(cfg, world, GPU, global_batch=False)
    assert not held.held_batch and held.cfg.train == base.cfg.train and held.layout == base.layout
    assert config_inputs(held, world).values == config_inputs(base, world).values
    checked = 0
    for preset in PRESETS:
        run = at_preset(base, files, overrides, preset)
        if run is None:
            continue
        checked += 1
        text = plan_text(run, MEMORY)
        got = sections(text)
        goodput = config_inputs(run, world).values
        # the step time: the plan's step line, the goodput plan's step_s
        assert got["step"] == f"{goodput['step_s']:.2f}", preset
        # the checkpoint bytes: the memory table's line, the goodput plan's ckpt_gb_per_gpu
        assert got["table checkpoint"] == fmt_bytes(goodput["ckpt_gb_per_gpu"] * 1e9), preset
        oom = planned_memory(run)
        if run.layout.pp == 1:
            # the states and transient weights: memory table = largest micro-batch = oom event
            assert got["fit states"] == got["table states"] == fmt_bytes(oom["states_bytes"])
            if "table transient" in got:
                assert got["fit transient"] == got["table transient"], preset
            assert got["fit transient"] == fmt_bytes(oom["transient_weights_bytes"]), preset
            if run.layout.world_size == run.layout.shard:  # the backends' rows are this layout
                label = {"local": "local (1 rank)", "fsdp": "fsdp"}.get(
                    run.backend, f"zero-{run.cfg.parallel.zero_stage}"
                )
                row = one(rf"^  {re.escape(label)} +[\d.]+ +(\S+ \S+)", text).group(1)
                assert row == got["table states"], preset
            continue
        rows = stage_rows(text)
        most = max(rows.values(), key=lambda r: float(r["params"].rstrip("B")))
        assert got["table states"] == most["states"], preset  # the rank that holds the most
        assert got["table transient"] == most["transient"], preset
        limit = rows[int(got["fit rank"])]  # the rank that sets the largest micro-batch
        assert (got["fit states"], got["fit transient"]) == (limit["states"], limit["transient"])
        worst = rows[oom["pp_rank"]]
        assert fmt_bytes(oom["states_bytes"]) == worst["states"], preset
        assert fmt_bytes(oom["total_bytes"]) == worst["total"], preset
    assert checked >= 2  # FP16 is refused from 20B parameters: the others are checked


@pytest.mark.unit
def test_the_405b_recipe_plans_one_step_and_one_checkpoint_size(capsys):
    """Issue 49's two commands on the shipped recipe: `--goodput` takes the stages' step and
    checkpoint bytes (not 8192 tokens per GPU and 1/2048 of the model), `--propose`'s row of the
    recipe's own layout is its per-stage table and step line, and its micro-batch section fits
    the recipe's micro-batch."""
    recipe = str(ROOT / "configs/llama-405b.yaml")
    assert (
        main(["plan", recipe, "--world-size", "16384", "--gpu-memory", "80GiB", "--propose"]) == 0
    )
    text = capsys.readouterr().out
    got = sections(text)
    rows = stage_rows(text)
    proposed = one(
        r"^  tp 8 x pp 8 x dp 256 \(v8\) +8 +[\d.]+% +(\S+ \S+) +([\d.]+) .*<- proposed$", text
    )
    assert proposed.group(1) == max(
        (r["total"] for r in rows.values()), key=lambda t: float(t.split()[0])
    )
    assert proposed.group(2) == got["step"]
    block = one(r"^  block +(\d+)", text.split("largest pipeline micro-batch")[1])
    assert int(block.group(1)) >= 1 and "exceeds" not in text  # one sequence per micro-batch fits
    # one pipeline rank holds 1/8 of the blocks: its checkpoint is about 12 B x 406B / 8 / 2048
    assert main(["plan", recipe, "--goodput", "--gpus", "16384", "--json", "--trials", "2"]) == 0
    inputs = json.loads(capsys.readouterr().out)["inputs"]
    assert f"{inputs['step_s']:.2f}" == got["step"]
    assert fmt_bytes(inputs["ckpt_gb_per_gpu"] * 1e9) == got["table checkpoint"]
    assert inputs["ckpt_gb_per_gpu"] == pytest.approx(12 * 405.85e9 / 8 / 2048 / 1e9, rel=0.05)


@pytest.mark.unit
def test_the_goodput_plan_takes_a_runs_batch_where_it_divides_and_says_when_it_holds_one():
    """The 70B's 1,024 sequences: 2 per GPU at 512 GPUs (as a run derives them, and as `bigtrain
    plan --world-size 512` shows), held at 1 per GPU at 16,384 where they do not divide."""
    cfg = load_config([str(ROOT / "configs/llama-70b.yaml")], [])
    at_512 = planned(cfg, 512, GPU, global_batch=False)
    assert not at_512.held_batch and at_512.cfg.train.grad_accum_steps == 2
    assert at_512.cfg.train == planned(cfg, 512, GPU).cfg.train
    at_16k = planned(cfg, 16384, GPU, global_batch=False)
    assert at_16k.held_batch and at_16k.cfg.train == cfg.train
    with pytest.raises(ConfigError, match="train.global_batch_size"):
        planned(cfg, 16384, GPU)  # `bigtrain plan` itself says what does not divide
    notes = config_inputs(at_16k, 16384).notes
    assert any("does not divide over the 16384 data-parallel ranks" in n for n in notes), notes
    assert not config_inputs(at_512, 512).notes
    # twice the sequences: the compute part of the step doubles
    assert step_time(at_512).parts["compute"] == pytest.approx(
        2 * step_time(at_16k).parts["compute"]
    )
