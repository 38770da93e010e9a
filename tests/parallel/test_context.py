"""Context parallelism (parallel/context/): the sequence split over cp ranks, attention across
them by a ring or by all-to-all, trained against one process."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from bigtrain.config import load_config
from bigtrain.errors import ConfigError
from bigtrain.parallel.context import kernels
from bigtrain.parallel.context.attention import ContextAttention, _pairs, kv_repeats
from bigtrain.parallel.context.split import ContextSplit
from bigtrain.parallel.layout import Layout
from bigtrain.store.rundir import read_jsonl
from tests.conftest import run_cli
from tests.distributed import by_step, mesh_run_args, run_distributed, train_run
from tests.models import HF_LLAMA

HF = ("model.kind=hf", HF_LLAMA)

LLAMA = (
    "model.position=rope",
    "model.norm=rmsnorm",
    "model.mlp=swiglu",
    "model.bias=false",
    "model.n_heads=4",
    "model.n_kv_heads=1",  # grouped: fewer key/value heads than the all-to-all degree
)


def reference_attention(q, k, v, documents=None):
    mask = None
    if documents is not None:
        same = documents[:, :, None] == documents[:, None, :]
        mask = (same & torch.ones_like(same[0]).tril()).unsqueeze(1)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=k.shape[1] != q.shape[1]
    )


def _inputs(dtype=torch.float32, kv_heads=2, seq=32, documents=True, device="cpu", dim=8):
    torch.manual_seed(0)
    q = torch.randn(2, 4, seq, dim, dtype=dtype)
    k, v = (torch.randn(2, kv_heads, seq, dim, dtype=dtype) for _ in range(2))
    grad = torch.randn(2, 4, seq, dim, dtype=dtype)
    # documents of 5, 20 and the rest (boundaries inside chunks), and one whole sequence
    docs = torch.tensor([[0] * 5 + [1] * 20 + [2] * (seq - 25), [0] * seq]) if documents else None
    return [t if t is None else t.to(device) for t in (q, k, v, grad, docs)]


def attention_errors(
    split: ContextSplit, dtype, kv_heads, documents, device="cpu", seq=32, dim=8
) -> list[float]:
    """Largest differences of this rank's output and q, k, v gradients from SDPA over the whole
    sequence (each rank computes the reference itself from the same seed)."""
    q, k, v, grad, docs = _inputs(dtype, kv_heads, seq, documents, device, dim)
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    out = reference_attention(*whole, docs)
    (out * grad).sum().backward()
    mine = [split.local(t, dim=2).clone().requires_grad_() for t in (q, k, v)]
    y = ContextAttention(split)(*mine, docs)
    (y * split.local(grad, dim=2)).sum().backward()
    pairs = [(y, out)] + [(a.grad, b.grad) for a, b in zip(mine, whole, strict=True)]
    return [(a.float() - split.local(b, dim=2).float()).abs().max().item() for a, b in pairs]


def _ranks_attention(cases):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    out = {}
    for style, dtype, kv_heads, documents in cases:
        split = ContextSplit(world, rank, style, dist.group.WORLD)
        out[(style, dtype, kv_heads, documents)] = attention_errors(
            split, getattr(torch, dtype), kv_heads, documents
        )
    dist.destroy_process_group()
    return out


CASES = [
    (style, dtype, kv_heads, documents)
    for style in ("ring", "all_to_all")
    for dtype, kv_heads, documents in (
        ("float32", 2, False),
        ("float32", 1, True),  # one key/value head for 4 ranks: all_to_all repeats it
        ("bfloat16", 4, True),
    )
]


@pytest.mark.distributed
def test_ring_and_all_to_all_attention_on_4_ranks_equal_sdpa_over_the_whole_sequence():
    """4 cp ranks (a ring of 4 hops, each rank 2 of 8 chunks; 4 head shares): outputs and q,
    k, v gradients equal SDPA's over the whole sequence, with document masks whose boundaries
    fall inside chunks and grouped key/value heads. FP32 to rounding (the merge by log-sum-exp
    reorders sums); BF16 within 2 of its rounding steps of the values' size (about 4)."""
    per_rank = run_distributed(_ranks_attention, 4, CASES)
    for errors in per_rank:
        for (style, dtype, kv, docs), errs in errors.items():
            bound = 1e-5 if dtype == "float32" else 2 * 2**-8 * 4
            assert max(errs) < bound, (style, dtype, kv, docs, errs)


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_ring_of_one_rank_merges_its_chunks_like_sdpa(dtype):
    """Degree 1: the ring's own blocks (two chunks: diagonal causal, off-diagonal whole) merged by
    log-sum-exp, and its backward from the merged statistics, without any process group."""
    split = ContextSplit(1, 0, "ring")
    errors = attention_errors(split, dtype, 2, documents=True)
    assert max(errors) < (1e-5 if dtype == torch.float32 else 0.04), errors


@pytest.mark.unit
@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU (bench/gpu.sh runs it); the CUDA kernels' shapes are tested on "
    "meta tensors below",
)
@pytest.mark.parametrize("documents", [False, True])
def test_a_ring_of_one_rank_on_cuda_merges_like_sdpa(documents):
    """The CUDA kernels (flash without a mask, memory-efficient with the document mask) in the
    ring's blocks and backward, against SDPA on the GPU, BF16, 1000-token chunks."""
    split = ContextSplit(1, 0, "ring")
    errors = attention_errors(split, torch.bfloat16, 2, documents, "cuda", seq=2000, dim=64)
    assert max(errors) < 0.05, errors


@pytest.mark.unit
def test_the_ring_gives_every_rank_the_same_work_at_every_step():
    """Chunks i and 2d-1-i: each step of the ring is two chunk-sized blocks' worth of work on
    every rank (a diagonal block counts half), so no rank waits for another."""
    for degree in (2, 3, 4, 8):
        for rank in range(degree):
            split = ContextSplit(degree, rank, "ring")
            for step in range(degree):
                owner = (rank - step) % degree
                work = sum(0.5 if x == y else 1 for _, x, _, y in _pairs(split, owner))
                assert work == 2, (degree, rank, step, work)
        # together the ranks cover every (query chunk, key chunk) pair below the diagonal once
        covered = sorted(
            (x, y)
            for rank in range(degree)
            for owner in range(degree)
            for _, x, _, y in _pairs(ContextSplit(degree, rank, "ring"), owner)
        )
        assert covered == [(x, y) for x in range(2 * degree) for y in range(x + 1)]


@pytest.mark.unit
def test_split_cuts_and_gathers_by_chunk():
    seq = torch.arange(16).unsqueeze(0)
    ring = [ContextSplit(2, r, "ring") for r in (0, 1)]
    assert ring[0].local(seq).tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]
    assert ring[1].local(seq).tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    assert ring[1].positions(16, "cpu").tolist() == list(range(4, 12))
    a2a = ContextSplit(4, 3, "all_to_all")
    assert a2a.local(seq).tolist() == [[12, 13, 14, 15]]
    assert [kv_repeats(kv, 4) for kv in (1, 2, 4, 8, 6)] == [4, 2, 1, 1, 2]


@pytest.mark.unit
def test_cuda_kernels_keep_the_rings_shapes_on_meta_tensors():
    """The CUDA paths (flash without a mask, memory-efficient with one), run on meta tensors: the
    log-sum-exp the ring merges is FP32 (batch, heads, rows), the efficient kernel's padded one
    cut to the rows and padded back for its backward, gradients of q, k, v's shapes."""
    q = torch.empty(2, 4, 40, 64, dtype=torch.bfloat16, device="meta")
    k = v = torch.empty(2, 4, 40, 64, dtype=torch.bfloat16, device="meta")
    bias = torch.zeros(2, 1, 40, 40, dtype=torch.bfloat16, device="meta")
    for mask in (None, bias):
        block = kernels.forward(
            q, k, v, causal=mask is None, bias=mask, scale=0.125, device_type="cuda"
        )
        assert block.out.shape == q.shape and block.out.dtype == torch.bfloat16
        assert block.lse.shape == (2, 4, 40) and block.lse.dtype == torch.float32
        grads = kernels.backward(
            q, q, k, v, block.out, block.lse, block.saved,
            causal=mask is None, bias=mask, scale=0.125, device_type="cuda",
        )  # fmt: skip
        assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    assert kernels._aligned(torch.zeros(2, 1, 5, 40)).stride()[-2] == 48  # rows 16-aligned


@pytest.mark.unit
def test_layout_puts_cp_between_shard_and_tp():
    cfg = load_config(
        [],
        [
            "parallel.backend=fsdp",
            "parallel.context_parallel=2",
            "parallel.replicate=2",
            "model.seq_len=32",
        ],
    ).parallel
    layouts = [Layout.of(cfg, 8, rank) for rank in range(8)]
    assert (layouts[0].shard, layouts[0].cp, layouts[0].dp_size) == (2, 2, 4)
    assert [lay.coord("cp") for lay in layouts] == [0, 1] * 4
    # the cp ranks of a data-parallel rank read its slice; both hold a loss
    assert [lay.dp_rank for lay in layouts] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert layouts[0].model_size == 2 and layouts[0].loss_ranks == 8
    assert layouts[0].describe() == "replicate 2 x shard 2 x cp 2"
    assert layouts[3].context_split() == ContextSplit(2, 1, "ring")


@pytest.mark.unit
@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["model.seq_len=36"], "'model.seq_len' (36) must be a multiple of 8"),
        (["parallel.cp_style=all_to_all", "parallel.context_parallel=3", "model.seq_len=36"],
         "must divide the query heads of each rank (4"),
        (["parallel.backend=zero"], "needs parallel.backend=fsdp: DeepSpeed's own sequence"),
        (["parallel.backend=local"], "needs parallel.backend=fsdp (the cp ranks"),
        (["model.dropout=0.1"], "'model.dropout' (0.1) must be 0"),
        (["parallel.cp_style=ulysses"], "'parallel.cp_style' got 'ulysses'"),
        (["parallel.context_parallel=0"], "'parallel.context_parallel' got 0"),
        (["model.kind=hf", "model.hf_config={model_type: gpt2}"],
         "model_type 'gpt2' is not split by sequence (supported: llama"),
        (["parallel.tensor_parallel=4", "model.seq_len=24"],
         "must divide the tokens each cp rank holds (model.seq_len 24 / parallel.context_parallel 4)"),
    ],
)  # fmt: skip
def test_context_keys_that_cannot_work_name_the_key(overrides, key):
    base = ["parallel.backend=fsdp", "parallel.context_parallel=4", "model.seq_len=32"]
    with pytest.raises(ConfigError) as e:
        load_config([], base + ["model.n_heads=4", "model.d_model=64", *overrides])
    assert key in str(e.value)


# --- training against one process ------------------------------------------------------------

STEPS = ("train.max_steps=8", "checkpoint.every=4", "checkpoint.async_save=false")
HEAL = ("resilience.snapshot_every=2", "monitor.every=1", "drill.nan_grad_step=3")


def _losses(result: dict) -> dict[int, float]:
    return by_step(result, "loss")


def _eval(result: dict) -> dict[int, float]:
    return by_step(result, "val_loss")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus_files, cache_dir):
    """Llama style (rope, grouped kv, documents, MoE) by a ring of 2, stopped at step 4 and
    resumed on one process, with a NaN drill on cp rank 1 at step 3; GPT-2 style (learned
    positions) by one process to step 4 and resumed on an all-to-all of 2 x tp 2 (4 ranks) with
    evaluations and samples; each against one process that never changed."""
    tmp = tmp_path_factory.mktemp("context")

    def args(name, *extra):
        return mesh_run_args(tmp, name, corpus_files, cache_dir, *STEPS, *extra)

    llama = (*LLAMA, "data.document_mask=true", "model.moe.experts=4", *HEAL)
    cp2 = ("parallel.backend=fsdp", "parallel.context_parallel=2")
    out = {"dir": tmp, "llama": train_run(args("llama", *llama))}
    ring = [*args("ring", *llama), "drill.rank=1"]
    out["ring"] = run_distributed(train_run, 2, [*ring, *cp2, "train.stop_at_step=4"])
    out["ring_resumed"] = train_run(ring)
    evals = (
        "model.n_heads=4",  # one head per rank of tp 2 x cp 2
        "train.eval_every=4",
        "eval.sample_every=4",
        "eval.sample_max_new_tokens=8",
    )
    out["gpt2"] = train_run(args("gpt2", *evals))
    a2a = args("a2a", *evals)
    out["a2a_first"] = train_run([*a2a, "train.stop_at_step=4"])
    tp2 = ("parallel.tensor_parallel=2", "parallel.cp_style=all_to_all")
    out["a2a"] = run_distributed(train_run, 4, [*a2a, *cp2, *tp2])
    return out


@pytest.mark.distributed
def test_a_ring_of_two_trains_like_one_process_and_resumes_on_one(runs):
    reference, ranks, resumed = runs["llama"], runs["ring"], runs["ring_resumed"]
    ref = _losses(reference)
    assert sorted(ref) == list(range(1, 9))
    for step, loss in _losses(ranks[0]).items():  # steps 1-4 on the ring (3 rolled back)
        assert loss == pytest.approx(ref[step], rel=1e-5, abs=1e-6), step
    assert sorted(_losses(ranks[0])) == [1, 2, 3, 4]
    for step in range(5, 9):  # resumed on one process from the ring's checkpoint
        assert _losses(resumed)[step] == pytest.approx(ref[step], rel=1e-5, abs=1e-6), step
    # the NaN on cp rank 1 only: one verdict on both ranks, one rollback target, as one process
    expected = next(e for e in reference["events"] if e["kind"] == "rollback")
    assert expected["from_step"] == 3
    for r in ranks:
        rollback = next(e for e in r["events"] if e["kind"] == "rollback")
        assert (rollback["from_step"], rollback["to_step"]) == (3, expected["to_step"])
    assert ranks[0]["final"] == ranks[1]["final"] == {"step": 4, "stopped": True}
    # the ring's own checkpoint exports to Hugging Face (a Mixtral: every block MoE) with equal
    # logits, and generates
    written = runs["dir"] / "ring" / "checkpoints" / "step_00000004"
    exported = run_cli("export", str(written), "--hf", str(runs["dir"] / "hf"), "--check")
    assert exported.returncode == 0, exported.stderr[-2000:]
    assert json.loads(exported.stdout.strip().splitlines()[-1])["check"]["ok"]
    generated = run_cli("generate", str(written), "--prompt", "ROMEO:", "--max-new-tokens", "4")
    assert generated.returncode == 0 and generated.stdout.strip(), generated.stderr[-2000:]


@pytest.mark.distributed
def test_an_all_to_all_of_two_with_tp_resumes_a_one_process_run_and_evaluates_like_it(runs):
    reference, ranks = runs["gpt2"], runs["a2a"]
    ref = _losses(reference)
    assert sorted(_losses(ranks[0])) == list(range(1, 9))  # 1-4 by one process, 5-8 by cp
    for step in range(5, 9):
        assert _losses(ranks[0])[step] == pytest.approx(ref[step], rel=1e-5), step
    assert _eval(ranks[0])[8] == pytest.approx(_eval(reference)[8], rel=1e-5)
    assert len({r["final"]["fingerprint"] for r in ranks}) == 1
    # greedy samples from logits gathered over the cp ranks: the same tokens as one process
    made = [read_jsonl(runs["dir"] / name / "samples.jsonl") for name in ("a2a", "gpt2")]
    assert [s["step"] for s in made[0]] == [4, 8]  # step 4 by the first, one-process part
    assert made[0][-1]["tokens"] == made[1][-1]["tokens"] and len(made[0][-1]["tokens"]) > 0


@pytest.mark.distributed
def test_a_transformers_llama_trains_by_ring_and_all_to_all_like_one_process(
    tmp_path, corpus_files, cache_dir
):
    """transformers' Llama through its attention registry: each style of 2 cp ranks follows one
    process within 1e-5 per step (FP32), position ids true, grouped key/value heads."""

    def args(name, *extra):
        return mesh_run_args(
            tmp_path, name, corpus_files, cache_dir, "train.max_steps=4", *HF, *extra
        )

    reference = _losses(train_run(args("one")))
    for style in ("ring", "all_to_all"):
        cp2 = ("parallel.backend=fsdp", "parallel.context_parallel=2", f"parallel.cp_style={style}")
        ranks = run_distributed(train_run, 2, args(style, *cp2))
        for step, loss in _losses(ranks[0]).items():
            assert loss == pytest.approx(reference[step], rel=1e-5), (style, step)
        assert len(_losses(ranks[0])) == 4
        assert ranks[0]["final"]["fingerprint"] == ranks[1]["final"]["fingerprint"]


@pytest.mark.distributed
def test_pipeline_stages_of_two_cp_ranks_train_like_one_process(tmp_path, corpus_files, cache_dir):
    """pp 2 x cp 2 (4 ranks, 1F1B, a ring): the second stage's hidden states are its cp rank's
    chunks and its rotary positions come from the split; losses equal one process's within
    1e-5 (FP32), and every rank ends with the same weights."""

    def args(name, *extra):
        return mesh_run_args(
            tmp_path, name, corpus_files, cache_dir, "train.max_steps=4", *LLAMA, *extra
        )

    reference = _losses(train_run(args("one")))
    stages = (
        "parallel.pipeline_parallel=2",
        "parallel.backend=fsdp",
        "parallel.context_parallel=2",
    )
    ranks = run_distributed(train_run, 4, args("pp2cp2", *stages))
    losses = next(_losses(r) for r in ranks if _losses(r))
    assert sorted(losses) == [1, 2, 3, 4]
    for step, loss in losses.items():
        assert loss == pytest.approx(reference[step], rel=1e-5), step
    assert len({r["final"]["fingerprint"] for r in ranks}) == 1


@pytest.mark.distributed
def test_experts_split_over_ep_ranks_of_each_chunk_train_like_one_process(
    tmp_path, corpus_files, cache_dir
):
    """ep 2 x cp 2 (4 ranks): an ep group is the shard ranks holding the same chunks, and the
    experts are FSDP2-sharded over edp x cp (a mesh built from the ranks permuted); losses
    equal one process's within 1e-5 (FP32), every rank ends with the same weights."""

    def args(name, *extra):
        return mesh_run_args(
            tmp_path, name, corpus_files, cache_dir, "train.max_steps=4", "model.moe.experts=4",
            *extra,
        )  # fmt: skip

    reference = _losses(train_run(args("one")))
    split = ("parallel.backend=fsdp", "parallel.expert_parallel=2", "parallel.context_parallel=2")
    ranks = run_distributed(train_run, 4, args("ep2cp2", *split))
    assert sorted(_losses(ranks[0])) == [1, 2, 3, 4]
    for step, loss in _losses(ranks[0]).items():
        assert loss == pytest.approx(reference[step], rel=1e-5), step
    assert len({r["final"]["fingerprint"] for r in ranks}) == 1
