"""The one parallel layout (bigtrain/parallel/layout.py): every size, coordinate and derived
number for small worlds, its errors, the global batch, and that nothing else derives the layout
from the world size."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest
import torch

from bigtrain.config import load_config
from bigtrain.errors import ConfigError
from bigtrain.parallel.layout import Layout
from tests.conftest import run_cli

HF = "model.kind=hf"
LLAMA = "model.hf_config={model_type: llama}"
PLAN = "parallel.tp_plan={q_proj: colwise, o_proj: rowwise}"
PACKAGE = Path(__file__).resolve().parents[2] / "bigtrain"


def parallel(*overrides: str):
    return load_config([], ["parallel.backend=fsdp", *overrides]).parallel


def shapes(max_world: int):
    """Every (world, replicate, tp) with replicate x tp dividing world, up to `max_world`."""
    for world in range(1, max_world + 1):
        for replicate, tp in itertools.product(range(1, world + 1), repeat=2):
            if world % (replicate * tp) == 0:
                yield world, replicate, tp


@pytest.mark.unit
@pytest.mark.parametrize(("world", "replicate", "tp"), list(shapes(4)))
def test_every_derived_number_for_one_to_four_ranks(world, replicate, tp):
    """Against a list of the ranks built independently: tp innermost, then shard, then replicate
    (row-major); a data-parallel rank is one (replicate, shard) pair; its tp ranks read its
    slice and share its loss."""
    overrides = [f"parallel.replicate={replicate}"]
    if tp > 1:
        overrides += [HF, LLAMA, PLAN, f"parallel.tensor_parallel={tp}"]
    shard = world // (replicate * tp)
    grid = list(itertools.product(range(replicate), range(shard), range(tp)))
    assert len(grid) == world
    slices = sorted({(r, s) for r, s, _ in grid})
    for rank, (r, s, t) in enumerate(grid):
        layout = Layout.of(parallel(*overrides), world, rank)
        assert (layout.replicate, layout.shard, layout.tp) == (replicate, shard, tp)
        assert (layout.pp, layout.ft, layout.ep, layout.ft_group) == (1, 1, 1, 0)
        assert layout.coords == {
            "ft": 0, "pp": 0, "replicate": r, "shard": s, "cp": 0, "tp": t, "ep": 0
        }  # fmt: skip
        assert layout.dp_size == replicate * shard == len(slices)
        assert layout.dp_rank == slices.index((r, s))
        assert layout.model_size == tp  # the ranks of one model copy: its tp group
        assert layout.loss_ranks == world and layout.holds_loss
        assert layout.distributed == (world > 1)
        assert layout.global_batch(3, 2) == 6 * len(slices)
        sizes = {"replicate": replicate, "shard": shard, "tp": tp}
        kept = [a for a in ("replicate", "shard", "tp") if a == "shard" or sizes[a] > 1]
        assert layout.mesh_axes == tuple(kept)
        assert layout.mesh_sizes == tuple(sizes[a] for a in kept)


@pytest.mark.unit
def test_the_layout_describes_its_axes_and_is_the_same_at_every_rank():
    layout = Layout.of(
        parallel("parallel.replicate=2", HF, LLAMA, PLAN, "parallel.tensor_parallel=2"), 8
    )
    assert layout.describe() == "replicate 2 x shard 2 x tp 2"
    assert Layout.of(parallel(), 4).describe() == "shard 4"
    same = parallel("parallel.replicate=2", HF, LLAMA, PLAN, "parallel.tensor_parallel=2")
    assert layout.at_rank(5) == Layout.of(same, 8, 5)
    assert [layout.at_rank(r).dp_rank for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]


@pytest.mark.unit
def test_sizes_that_do_not_divide_name_the_keys_and_the_numbers():
    with pytest.raises(
        ConfigError,
        match=r"parallel.replicate' \(3\) x parallel.tensor_parallel \(1\) = 3 must divide the world size \(4\)",
    ):
        Layout.of(parallel("parallel.replicate=3"), 4)
    with pytest.raises(
        ConfigError, match=r"\(2\) x parallel.tensor_parallel \(4\) = 8 must divide"
    ):
        Layout.of(
            parallel("parallel.replicate=2", HF, LLAMA, PLAN, "parallel.tensor_parallel=4"), 4
        )


@pytest.mark.unit
def test_global_batch_size_derives_grad_accum_at_each_world_size():
    train = load_config([], ["train.global_batch_size=64", "train.micro_batch_size=8"]).train
    accum = [Layout.of(parallel(), ws).batch(train).grad_accum_steps for ws in (1, 2, 4, 8)]
    assert accum == [8, 4, 2, 1]
    assert Layout.of(parallel(), 2).batch(train).global_batch_size == 64
    plain = load_config([], ["train.grad_accum_steps=3"]).train
    assert Layout.of(parallel(), 4).batch(plain) is plain  # without a global batch: nothing
    with pytest.raises(
        ConfigError, match=r"\(64\) must be a positive multiple .* \(8\) x world size \(3\) = 24"
    ):
        Layout.of(parallel(), 3).batch(train)
    with pytest.raises(ConfigError, match=r"world size \(16\) = 128"):
        Layout.of(parallel(), 16).batch(train)
    both = load_config(
        [], ["train.global_batch_size=64", "train.micro_batch_size=8", "train.grad_accum_steps=3"]
    ).train
    with pytest.raises(
        ConfigError, match=r"grad_accum_steps' \(3\) disagrees .* gives 4 at world size 2"
    ):
        Layout.of(parallel(), 2).batch(both)
    with pytest.raises(ConfigError, match="train.global_batch_size' got 0"):
        load_config([], ["train.global_batch_size=0"])


@pytest.mark.unit
def test_under_tp_the_global_batch_counts_data_parallel_ranks():
    cfg = load_config(
        ["configs/parallel/tp2-hf-llama.yaml"],
        [HF, LLAMA, "train.global_batch_size=16", "train.micro_batch_size=4"],
    )
    layout = Layout.of(cfg.parallel, 8)  # 8 ranks, tp 2: 4 read the data
    assert layout.dp_size == 4 and layout.batch(cfg.train).grad_accum_steps == 1
    cfg = load_config(
        ["configs/parallel/tp2-hf-llama.yaml"],
        [
            HF,
            LLAMA,
            "train.global_batch_size=16",
            "train.micro_batch_size=4",
            "parallel.tensor_parallel=1",
        ],
    )
    with pytest.raises(ConfigError, match=r"\(4\) x world size \(8\) = 32"):
        Layout.of(cfg.parallel, 8).batch(cfg.train)


def _mentions_world_size(node: ast.AST) -> bool:
    text = ast.unparse(node)
    return "world_size" in text


def world_size_arithmetic(path: Path) -> list[str]:
    """Divisions and modulos with the world size as an operand (`/`, `//`, `%`, `divmod`)."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        operands: list[ast.AST] = []
        if isinstance(node, (ast.BinOp, ast.AugAssign)) and isinstance(
            node.op, (ast.Div, ast.FloorDiv, ast.Mod)
        ):
            operands = [
                node.left if isinstance(node, ast.BinOp) else node.target,
                node.right if isinstance(node, ast.BinOp) else node.value,
            ]
        elif isinstance(node, ast.Call) and ast.unparse(node.func) == "divmod":
            operands = list(node.args)
        if any(_mentions_world_size(o) for o in operands):
            found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {ast.unparse(node)}")
    return found


@pytest.mark.unit
def test_only_the_layout_divides_the_world_size():
    """Sizes and ranks are derived in one place: no other module divides or takes a modulo of
    the world size (or of dist.get_world_size())."""
    found = [
        hit
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "layout.py" or path.parent.name != "parallel"
        for hit in world_size_arithmetic(path)
    ]
    assert not found, "\n".join(found)
    sample = PACKAGE / "parallel" / "layout.py"
    assert world_size_arithmetic(sample), "the check finds the layout's own divisions"


@pytest.mark.unit
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallel.replicate=0"], "expected a positive integer"),
        (["parallel.backend=zero", "parallel.replicate=2"], "needs parallel.backend=fsdp"),
        (["parallel.tensor_parallel=0"], "expected a positive integer"),
        (
            ["parallel.backend=zero", HF, LLAMA, PLAN, "parallel.tensor_parallel=2"],
            "needs parallel.backend",
        ),
        (
            [HF, LLAMA, "parallel.tp_plan={q_proj: diagonal}"],
            "expected one of colwise, rowwise, colwise_gather_output",
        ),
    ],
)
def test_bad_replicate_settings_are_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config([], ["parallel.backend=fsdp", *overrides])


@pytest.mark.e2e
def test_a_mesh_that_does_not_divide_the_launched_world_exits_2_with_the_numbers(tmp_path):
    """Checked before the process group starts: one of the 4 launched ranks is enough to see it."""
    env = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    result = run_cli(
        "train",
        "configs/tiny.yaml",
        "parallel.backend=fsdp",
        "parallel.replicate=3",
        f"train.out_dir={tmp_path / 'run'}",
        env={**env, "MASTER_PORT": "29999"},
    )
    assert result.returncode == 2, result.stderr
    assert "(3) x parallel.tensor_parallel (1) = 3 must divide the world size (4)" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.unit
def test_the_tp2_preset_takes_the_plan_the_family_declares():
    """No parallel.tp_plan: a transformers model is split by its family's declared plan (the
    Llama family's q/k/v and gate/up colwise, o/down rowwise), read at build."""
    from bigtrain.model.hf import build_hf
    from bigtrain.model.hf_plans import family_plans

    cfg = load_config(["configs/parallel/tp2-hf-llama.yaml"], [HF, LLAMA])
    assert cfg.parallel.tensor_parallel == 2 and cfg.parallel.tp_plan == {}
    with torch.device("meta"):  # Llama's default widths: 6.7B parameters
        plans = family_plans(build_hf(cfg.model.hf_config, None, 384).hf)
    assert plans.tp == {
        "self_attn.q_proj": "colwise",
        "self_attn.k_proj": "colwise",
        "self_attn.v_proj": "colwise",
        "self_attn.o_proj": "rowwise",
        "mlp.gate_proj": "colwise",
        "mlp.up_proj": "colwise",
        "mlp.down_proj": "rowwise",
    }


@pytest.mark.unit
def test_a_resumed_global_batch_is_kept_at_another_world_size():
    train = load_config([], ["train.micro_batch_size=16"]).train
    two = Layout.of(parallel(), 2)
    kept, note = two.keep_global_batch(train, saved=16, saved_micro=16)
    assert (kept.micro_batch_size, kept.grad_accum_steps) == (8, 1)
    assert two.global_batch(kept.micro_batch_size, kept.grad_accum_steps) == 16
    assert note == (
        "global batch kept at 16 sequences on 2 data-parallel ranks: train.micro_batch_size "
        "16 -> 8 (this config gives 32 here)"
    )
    # fewer ranks: the micro-batch (a memory knob) stays, the accumulation grows
    one = Layout.of(parallel(), 1)
    kept, _ = one.keep_global_batch(load_config([], ["train.micro_batch_size=4"]).train, 16, 4)
    assert (kept.micro_batch_size, kept.grad_accum_steps) == (4, 4)
    # a micro-batch set for this resume is kept where it divides
    kept, _ = two.keep_global_batch(load_config([], ["train.micro_batch_size=2"]).train, 16, 16)
    assert (kept.micro_batch_size, kept.grad_accum_steps) == (2, 4)
    # nothing to do: the same global batch, or the user's own train.global_batch_size
    assert (
        two.keep_global_batch(load_config([], ["train.micro_batch_size=8"]).train, 16, 8)[1] is None
    )
    explicit = load_config([], ["train.global_batch_size=64", "train.micro_batch_size=8"]).train
    assert two.keep_global_batch(explicit, 16, 8) == (explicit, None)


@pytest.mark.unit
def test_a_global_batch_that_cannot_be_kept_names_the_numbers_and_the_keys():
    train = load_config([], ["train.micro_batch_size=16"]).train
    with pytest.raises(ConfigError) as e:
        Layout.of(parallel(), 3).keep_global_batch(train, saved=16, saved_micro=16)
    message = str(e.value)
    assert "global batch of 16 sequences cannot be kept at 3 data-parallel ranks" in message
    assert "16 is not a multiple of the 3 data-parallel ranks" in message
    assert "this run's config gives 48" in message
    assert "train.global_batch_size and checkpoint.allow_config_change=true" in message
    chosen = load_config([], ["train.micro_batch_size=3"]).train
    with pytest.raises(ConfigError, match=r"train.micro_batch_size=3 does not divide the 8"):
        Layout.of(parallel(), 2).keep_global_batch(chosen, saved=16, saved_micro=16)
