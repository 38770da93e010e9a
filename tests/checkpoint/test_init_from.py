"""Hugging Face export round trip, `model.init_from` a Hugging Face directory on every backend, and
from another backend's checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest

from bigtrain.checkpoint.convert import convert
from bigtrain.checkpoint.export import export_checkpoint
from bigtrain.checkpoint.manifest import verify
from bigtrain.config import load_config
from bigtrain.parallel.env import read_env
from bigtrain.runner import run
from bigtrain.store.rundir import read_jsonl
from tests.conftest import micro_overrides
from tests.distributed import run_distributed
from tests.models import GPT_LLAMA_STYLE

pytestmark = pytest.mark.distributed

LAYOUTS = {
    "gpt2": ["model.tie_embeddings=true"],
    "llama": [*GPT_LLAMA_STYLE, "model.tie_embeddings=false"],
}
BACKENDS = {
    "local": ["parallel.backend=local"],
    "fsdp": ["parallel.backend=fsdp"],
    "zero3": ["parallel.backend=zero", "parallel.zero_stage=3"],
    "zero2": ["parallel.backend=zero", "parallel.zero_stage=2"],
}


def train(overrides: list[str]) -> dict:
    cfg = load_config([], overrides)
    final = run(cfg, read_env())
    records = read_jsonl(Path(cfg.train.out_dir) / "metrics.jsonl")
    val = {m["step"]: m["val_loss"] for m in records if "val_loss" in m}
    return {"final": final, "val": val}


def launch(backend: str, overrides: list[str]) -> dict:
    args = [*overrides, *BACKENDS[backend]]
    if backend == "local":
        return train(args)
    # train.eval_batches is per rank: 2 ranks x 1 evaluate the 16 sequences local's 1 x 2 does
    return run_distributed(train, 2, [*args, "train.eval_batches=1"])[0]


def args_for(out: Path, layout: str, corpus_files, cache_dir, *extra: str) -> list[str]:
    return micro_overrides(out, corpus_files, cache_dir) + [
        *LAYOUTS[layout],
        "train.global_batch_size=16",
        "train.eval_every=6",
        "precision.compute_dtype=fp32",
        *extra,
    ]


@pytest.fixture(scope="module")
def exported(tmp_path_factory, corpus_files, cache_dir) -> dict:
    """Per layout: a 6-step local run, its validation loss at step 6, and its export (checked)."""
    tmp = tmp_path_factory.mktemp("init_from")
    out = {}
    for layout in LAYOUTS:
        args = args_for(tmp / layout, layout, corpus_files, cache_dir, "train.max_steps=6")
        result = launch("local", [*args, "checkpoint.every=6"])
        checkpoint = tmp / layout / "checkpoints" / "step_00000006"
        export = export_checkpoint(checkpoint, tmp / f"{layout}-hf", 1 << 16, check=True)
        out[layout] = {**result, "export": export, "dir": tmp / f"{layout}-hf"}
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_export_loads_in_transformers_with_the_same_logits_and_loss(
    exported, layout, tmp_path, corpus_files, cache_dir
):
    export = exported[layout]["export"]
    assert (
        export["architecture"] == {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}[layout]
    )
    assert export["check"]["ok"] and export["check"]["max_rel_diff"] <= 1e-4
    files = set(export["files"])
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= files
    assert "model.safetensors.index.json" in files  # 64 KiB shards: the micro model needs several
    # transformers' own model class on the same data gives the run's validation loss
    hf_dir = exported[layout]["dir"]
    args = micro_overrides(tmp_path / "hf", corpus_files, cache_dir) + [
        "model.kind=hf",
        f"model.hf_path={hf_dir}",
        "train.max_steps=1",
        "train.eval_every=6",
        "precision.compute_dtype=fp32",
    ]
    as_hf = launch("local", args)
    assert as_hf["val"][0] == pytest.approx(exported[layout]["val"][6], rel=1e-4)


@pytest.mark.parametrize(
    "layout,backend",
    [
        ("llama", "local"),
        ("llama", "fsdp"),
        ("llama", "zero3"),
        ("gpt2", "fsdp"),
        ("gpt2", "zero3"),
    ],
)
def test_init_from_an_export_gives_the_same_validation_loss(
    exported, layout, backend, tmp_path, corpus_files, cache_dir
):
    hf_dir = exported[layout]["dir"]
    args = args_for(
        tmp_path / "run",
        layout,
        corpus_files,
        cache_dir,
        "train.max_steps=1",
        f"model.init_from={hf_dir}",
    )
    result = launch(backend, args)
    assert result["val"][0] == pytest.approx(exported[layout]["val"][6], rel=1e-4)
    event = next(
        e for e in read_jsonl(tmp_path / "run" / "events.jsonl") if e["kind"] == "init_from"
    )
    assert event["source"] == "huggingface" and event["path"] == str(hf_dir)
    assert event["fingerprint"] == exported[layout]["final"]["fingerprint"]  # the same weights


def test_start_from_a_zero_checkpoint_on_local_and_from_it_converted(
    tmp_path, corpus_files, cache_dir
):
    """A 2-rank ZeRO-2 checkpoint's weights, read by one process through DCP's resharding, and
    through the one-process file set `ckpt convert` writes: bit for bit the ZeRO run's."""
    args = args_for(tmp_path / "zero", "llama", corpus_files, cache_dir, "train.max_steps=4")
    source = launch("zero2", [*args, "checkpoint.every=4"])
    checkpoint = tmp_path / "zero" / "checkpoints" / "step_00000004"
    manifest = convert(checkpoint, tmp_path / "converted")
    assert manifest["backend"] == "zero" and manifest["world_size"] == 2
    assert manifest["converted_from"]["format_version"] == 2
    assert sorted(f for f in manifest["files"] if f.startswith("dcp/")) == [
        "dcp/.metadata",
        "dcp/__0_0.distcp",
    ]
    assert verify(tmp_path / "converted")["step"] == 4
    for start in (checkpoint, tmp_path / "converted"):
        out = tmp_path / f"again-{start.name}"
        extra = ("train.max_steps=1", f"model.init_from={start}")
        launch("local", args_for(out, "llama", corpus_files, cache_dir, *extra))
        event = next(e for e in read_jsonl(out / "events.jsonl") if e["kind"] == "init_from")
        assert event["fingerprint"] == source["final"]["fingerprint"]
        assert event["source"] == "checkpoint" and event["backend"] == "zero"


def test_init_from_a_hf_directory_into_a_transformers_model_on_fsdp(
    exported, tmp_path, corpus_files, cache_dir
):
    hf_dir = exported["llama"]["dir"]
    args = micro_overrides(tmp_path / "run", corpus_files, cache_dir) + [
        "model.kind=hf",  # the architecture from the directory's config.json
        f"model.init_from={hf_dir}",
        "train.global_batch_size=16",
        "train.max_steps=1",
        "train.eval_every=6",
        "precision.compute_dtype=fp32",
    ]
    result = launch("fsdp", args)
    assert result["val"][0] == pytest.approx(exported["llama"]["val"][6], rel=1e-4)
