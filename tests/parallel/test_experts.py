"""Expert parallelism (parallel/experts.py, model/moe.py's all-to-all) on 2 gloo ranks, FP32:
experts split over ep=2 train the per-step losses of ep=1 (every rank holding every expert),
route the same tokens to the same experts, resume on one process from an ep=2 checkpoint, and a
router-collapse drill on one rank is caught and rolled back on both."""

from __future__ import annotations

import pytest

from bigtrain.store.rundir import read_jsonl
from tests.distributed import by_step, mesh_run_args, run_distributed, train_run, train_run_probed

pytestmark = pytest.mark.distributed

MOE = ("model.moe.experts=4", "model.moe.top_k=2", "parallel.backend=fsdp")


def expert_shapes(trainer) -> dict:
    """A probe: this rank's slice of each MoE layer's experts and its ep group's size."""
    import torch.distributed as dist

    from bigtrain.model.moe import moe_layers
    from bigtrain.utils.tensors import local_block

    layers = moe_layers(trainer.backend.model)
    return {
        "blocks": [local_block(m.experts.w_up) for m in layers],
        "ep": [dist.get_world_size(m.ep_group) if m.ep_group else 1 for m in layers],
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus_files, cache_dir) -> dict:
    tmp = tmp_path_factory.mktemp("experts")
    out = {}
    for ep in (1, 2):
        args = mesh_run_args(
            tmp, f"ep{ep}", corpus_files, cache_dir, *MOE, f"parallel.expert_parallel={ep}"
        )
        out[ep] = run_distributed(train_run_probed, 2, args, expert_shapes)
    return out


def test_expert_parallel_2_equals_expert_parallel_1_per_step(runs):
    one, two = runs[1][0], runs[2][0]
    # ep=2: each rank holds 2 of the 4 experts (its rows 0-1 or 2-3); ep=1: all 4
    assert runs[2][0]["probe"]["ep"] == [2, 2]
    assert [b[0][0] for b in runs[2][0]["probe"]["blocks"]] == [0, 0]
    assert [b[0][0] for b in runs[2][1]["probe"]["blocks"]] == [2, 2]
    assert all(b[1][0] == 2 for r in runs[2] for b in r["probe"]["blocks"])
    assert runs[1][0]["probe"]["ep"] == [1, 1]  # FSDP2 alone: 4 experts sharded by rows
    losses_1, losses_2 = by_step(one, "loss"), by_step(two, "loss")
    assert sorted(losses_1) == sorted(losses_2) == list(range(1, 21))
    for step, loss in losses_1.items():
        assert losses_2[step] == pytest.approx(loss, rel=1e-5), step
    # The same tokens went to the same experts, counted over both ranks.
    for step in (1, 10, 20):
        assert by_step(two, "moe_layer_load")[step] == by_step(one, "moe_layer_load")[step]
    assert by_step(two, "moe_aux_loss")[20] == pytest.approx(by_step(one, "moe_aux_loss")[20])
    assert one["final"]["rollbacks"] == two["final"]["rollbacks"] == 0


def test_resume_expert_parallel_checkpoint_on_one_process(runs, tmp_path, corpus_files, cache_dir):
    args = mesh_run_args(tmp_path, "run", corpus_files, cache_dir, *MOE, "checkpoint.every=2")
    first = run_distributed(
        train_run, 2, [*args, "parallel.expert_parallel=2", "train.stop_at_step=10"]
    )
    assert first[0]["final"] == {"step": 10, "stopped": True}
    second = train_run([*args, "parallel.backend=local", "train.stop_at_step=14"])
    reference = by_step(runs[2][0], "loss")
    for step in range(11, 15):
        assert by_step(second, "loss")[step] == pytest.approx(reference[step], rel=1e-4), step
    # and on 2 ranks with the experts on both (expert_parallel 1), from the local run's step 14
    third = run_distributed(
        train_run, 2, [*args, "parallel.expert_parallel=1", "train.stop_at_step=16"]
    )
    for step in (15, 16):
        assert by_step(third[0], "loss")[step] == pytest.approx(reference[step], rel=1e-4), step


def test_router_collapse_drill_on_one_rank_rolls_back_both(tmp_path, corpus_files, cache_dir):
    args = mesh_run_args(
        tmp_path,
        "drill",
        corpus_files,
        cache_dir,
        *MOE,
        "parallel.expert_parallel=2",
        "train.max_steps=14",
        "resilience.snapshot_every=5",
        "resilience.confirm_steps=1",
        "drill.rank=1",
        "drill.router_bias=3",
        "drill.router_bias_step=12",
        "monitor.rules=[router_spread]",  # the one-rank rule alone catches it
    )
    results = run_distributed(train_run, 2, args)
    for result in results:
        assert result["final"]["rollbacks"] == 1 and result["final"]["step"] == 14
    events = read_jsonl(tmp_path / "drill" / "events.jsonl")
    anomaly = next(e for e in events if e["kind"] == "anomaly")
    assert anomaly["step"] == 12
    assert anomaly["metric"] == "router_spread" and anomaly["value"] > 8 * anomaly["baseline"]
    assert anomaly["tensor"] in ("blocks.0.moe.router.weight", "blocks.1.moe.router.weight")
    rollback = next(e for e in events if e["kind"] == "rollback")
    assert (rollback["from_step"], rollback["to_step"]) == (12, 10)
    # The biased rank sent every token to expert 3 (and one other): half of its pairs, a quarter
    # of all, whatever the healthy rank routed (shares are logged to 4 decimals).
    loads = [m["moe_layer_load"] for m in results[0]["metrics"] if m["step"] == 12]
    assert loads[0]["blocks.0"][3] >= 0.2499


def test_hsdp_with_expert_parallel_equals_hsdp_without(tmp_path, corpus_files, cache_dir):
    """4 ranks, replicate 2 x shard 2, the experts split over each replica's 2 shard ranks (their
    DTensors span replicate, edp and ep; HSDP all-reduces their gradients across replicas)
    against the same mesh with the experts on every rank. The same micro-batches: the balancing
    losses, per micro-batch, are the same too."""
    results = {}
    for ep in (1, 2):
        args = mesh_run_args(
            tmp_path,
            f"hsdp-ep{ep}",
            corpus_files,
            cache_dir,
            *MOE,
            "parallel.replicate=2",
            f"parallel.expert_parallel={ep}",
            "train.micro_batch_size=4",
            "train.max_steps=10",
        )
        results[ep] = run_distributed(train_run_probed, 4, args, expert_shapes)
    assert results[2][0]["probe"]["ep"] == [2, 2]
    reference, split = by_step(results[1][0], "loss"), by_step(results[2][0], "loss")
    assert sorted(split) == sorted(reference) == list(range(1, 11))
    for step, loss in split.items():
        assert loss == pytest.approx(reference[step], rel=1e-5), step


def test_zero_trains_an_moe_model_like_fsdp(runs, tmp_path, corpus_files, cache_dir):
    """DeepSpeed ZeRO-2 (no expert parallelism): its loss scaling and accumulation hand the
    balancing and z-losses the same gradient factor as the loss (aux_grad_scale)."""
    args = mesh_run_args(
        tmp_path,
        "zero",
        corpus_files,
        cache_dir,
        *MOE,
        "parallel.backend=zero",
        "parallel.zero_stage=2",
        "train.stop_at_step=6",
    )
    result = run_distributed(train_run, 2, args)[0]
    reference, zero = by_step(runs[1][0], "loss"), by_step(result, "loss")
    assert sorted(zero) == list(range(1, 7)) and zero.keys() <= reference.keys()
    for step, loss in zero.items():
        assert loss == pytest.approx(reference[step], rel=1e-5), step
    assert by_step(result, "moe_aux_loss")[6] == pytest.approx(
        by_step(runs[1][0], "moe_aux_loss")[6]
    )


def test_moe_blocks_in_pipeline_stages_follow_one_process(tmp_path, corpus_files, cache_dir):
    """2 pipeline stages of one MoE block each (local backend, 2 processes): the balancing
    losses are attached per stage, the routers' numbers of both stages reach every rank, and
    the losses equal one process's. GPipe with one pipeline micro-batch of the process's 8
    sequences: the balancing losses, per micro-batch, are computed over the same tokens."""
    common = (*MOE[:2], "train.stop_at_step=8")
    one = train_run(
        mesh_run_args(tmp_path, "one", corpus_files, cache_dir, *common, "parallel.backend=local")
    )
    args = mesh_run_args(
        tmp_path,
        "pp",
        corpus_files,
        cache_dir,
        *common,
        "parallel.backend=local",
        "parallel.pipeline_parallel=2",
        "parallel.pp_schedule=gpipe",
        "parallel.pp_microbatches=1",
    )
    staged = run_distributed(train_run, 2, args)
    reference, last = by_step(one, "loss"), by_step(staged[1], "loss")  # last stage: the loss
    assert sorted(last) == sorted(reference) == list(range(1, 9))
    for step, loss in last.items():
        assert loss == pytest.approx(reference[step], rel=1e-5), step
    for result in staged:  # every rank reads both stages' routers, each a whole step's tokens
        loads = by_step(result, "moe_layer_load")[8]
        assert set(loads) == {"blocks.0", "blocks.1"}
        assert all(sum(shares) == pytest.approx(1.0, abs=1e-3) for shares in loads.values())


def test_experts_sharded_over_two_data_ranks_each_train_like_one_process(
    tmp_path, corpus_files, cache_dir
):
    """shard 4, ep 2: each expert is FSDP2-sharded over 2 data ranks (edp 2), whose reduction's
    factor (every data rank of the job) is not its group's size; on gloo, which has no
    PREMUL_SUM, it sums and then divides. Losses equal one process's within 1e-5 (FP32)."""

    def args(name, *extra):
        return mesh_run_args(
            tmp_path, name, corpus_files, cache_dir, "train.max_steps=4",
            "model.moe.experts=4", "train.micro_batch_size=4", *extra,
        )  # fmt: skip

    reference = by_step(train_run(args("one")), "loss")
    ranks = run_distributed(train_run, 4, args("edp2", *MOE, "parallel.expert_parallel=2"))
    losses = by_step(ranks[0], "loss")
    assert sorted(losses) == [1, 2, 3, 4]
    for step, loss in losses.items():
        assert loss == pytest.approx(reference[step], rel=1e-5), step
    assert len({r["final"]["fingerprint"] for r in ranks}) == 1
