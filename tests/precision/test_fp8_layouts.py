"""FP8 under the layouts (spawned, world size 2, gloo): FSDP2 with and without the FP8 all-gather,
HSDP, tensor parallelism, pipeline stages; each against one process's FP8 run of the same
batches. A layer that falls back under the FP8 all-gather gathers in BF16."""

from __future__ import annotations

import pytest

from tests.distributed import by_step, run_distributed, train_run
from tests.models import GPT_LLAMA_STYLE

pytest.importorskip("torchao")

pytestmark = pytest.mark.distributed


def fp8_args(tmp, name, corpus_files, cache_dir, *extra: str) -> list[str]:
    from tests.conftest import micro_overrides

    return micro_overrides(tmp / name, corpus_files, cache_dir) + [
        *GPT_LLAMA_STYLE,
        "precision.compute_dtype=bf16",
        "precision.fp8.enabled=true",
        "precision.fp8.check_every=3",
        "train.global_batch_size=16",
        "train.max_steps=6",
        "train.log_every=1",
        "train.eval_every=0",
        "checkpoint.every=0",
        *extra,
    ]


LAYOUTS = {
    "fsdp": ("parallel.backend=fsdp", "checkpoint.every=6"),
    "fsdp_no_gather": ("parallel.backend=fsdp", "precision.fp8.all_gather=false"),
    "hsdp": ("parallel.backend=fsdp", "parallel.replicate=2"),
    "tp": ("parallel.backend=fsdp", "parallel.tensor_parallel=2"),
    "pp": ("parallel.backend=fsdp", "parallel.pipeline_parallel=2", "checkpoint.every=6"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus_files, cache_dir):
    tmp = tmp_path_factory.mktemp("fp8")
    out = {"tmp": tmp, "local": train_run(fp8_args(tmp, "local", corpus_files, cache_dir))}
    for name, extra in LAYOUTS.items():
        out[name] = run_distributed(
            train_run, 2, fp8_args(tmp, name, corpus_files, cache_dir, *extra)
        )
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_layout_trains_fp8_like_one_process(runs, layout):
    """FP8 casts are deterministic on CPU, but each layout sums in another order and casts what
    it holds: FSDP2 the same tensors (its FP8 all-gather casts the whole weight with the amax
    reduced over the shards: the cast one process makes); tensor parallelism the same global
    amax through DTensor. The BF16 rounding of sums in another order moves a loss by ~1e-3
    relative (measured for BF16 runs across these layouts); FP8 adds no more than that."""
    local, ranks = runs["local"], runs[layout]
    assert ranks[0]["final"]["fingerprint"] == ranks[1]["final"]["fingerprint"] or layout in (
        "tp",
        "pp",
    )
    reference, losses = by_step(local, "loss"), by_step(ranks[0], "loss")
    assert sorted(losses) == sorted(reference) == list(range(1, 7))
    for step, loss in reference.items():
        assert losses[step] == pytest.approx(loss, rel=1e-2), (layout, step)
    checked = [m for m in ranks[0]["metrics"] if "fp8_error_max" in m]
    assert [m["step"] for m in checked] == [3, 6]
    assert all(0 < m["fp8_error_max"] < 0.25 for m in checked), checked


def test_fsdp_with_fp8_gathers_resumes_on_the_same_trajectory(runs, corpus_files, cache_dir):
    """A run stopped at step 4 (its weights held in torchao's FP8-gathering tensors) and resumed
    to step 6 ends with the weights of the layout's run that trained 6 steps straight."""
    tmp, extra = runs["tmp"], LAYOUTS["fsdp"]
    args = fp8_args(tmp, "resumed", corpus_files, cache_dir, *extra)
    run_distributed(train_run, 2, [*args, "train.stop_at_step=4"])
    resumed = run_distributed(train_run, 2, args)
    assert [e for e in resumed[0]["events"] if e["kind"] == "resume"][-1]["step"] == 4
    assert resumed[0]["final"]["fingerprint"] == runs["fsdp"][0]["final"]["fingerprint"]


def fallback_under_gather(args: list[str]) -> dict:
    """A run whose layer falls back at step 2 under the FP8 all-gather, then trains on; the
    dtype its weight is gathered in afterwards."""
    from bigtrain.build import build_trainer
    from bigtrain.config import load_config
    from bigtrain.parallel.env import read_env, shutdown

    trainer = build_trainer(load_config([], args), read_env())
    seen = {}
    layer = trainer.setup.fp8_layers["blocks.0.mlp.up"]

    def note(module, args) -> None:
        weight = module.weight
        seen.setdefault(trainer.step, type(weight).__name__ + ":" + str(weight.dtype))

    layer.register_forward_pre_hook(note)
    try:
        trainer.fit()
        return {"dtypes": seen, "fp8": layer.fp8}
    finally:
        trainer.callbacks.close()
        shutdown(clean=False)


def test_a_layer_that_falls_back_gathers_in_bf16_from_then_on(tmp_path, corpus_files, cache_dir):
    args = fp8_args(
        tmp_path,
        "gather",
        corpus_files,
        cache_dir,
        "parallel.backend=fsdp",
        "drill.fp8_amax_step=[2]",
        "drill.fp8_layer=blocks.0.mlp.up",
        "train.max_steps=4",
    )
    r0, r1 = run_distributed(fallback_under_gather, 2, args)
    assert r0 == r1 and not r0["fp8"]
    # by the step count at the layer's first forward: torchao's FP8 tensors, gathered in FP8,
    # until the fallback (step 2's, decided after the step); plain BF16 weights after it
    dtypes = r0["dtypes"]
    assert dtypes[0] == dtypes[1] == "Float8TrainingTensor:torch.bfloat16", dtypes
    assert dtypes[max(dtypes)] == "Parameter:torch.bfloat16", dtypes
