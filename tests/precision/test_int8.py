"""INT8 forward for linear layers: the quantizers' error bound, the STE gradient, what is saved for
backward, exclusions, GPT-2's Conv1D, calibration across ranks and through a resume, and the tiny
model's validation loss against BF16."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from bigtrain.build import build_trainer
from bigtrain.config import load_config
from bigtrain.config.schema import Int8Config
from bigtrain.errors import ConfigError
from bigtrain.model.hf import build_hf
from bigtrain.parallel.env import DistEnv, read_env, shutdown
from bigtrain.precision.int8 import (
    Int8Linear,
    convert_to_int8,
    dequantize_rows,
    quantize_rows_affine,
    quantize_rows_symmetric,
)
from bigtrain.runner import run
from tests.conftest import ROOT, micro_overrides
from tests.distributed import run_distributed


def outlier_inputs(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Activations with a few large channels, as in real transformers."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    x[:, :3] *= 30.0
    return x


def error_bound(x: torch.Tensor, w: torch.Tensor, affine: bool) -> torch.Tensor:
    """|y - y_int8| <= s_x/2 sum_k |W_jk| + s_w_j/2 sum_k |x_hat_k| (module docstring), per output."""
    if affine:
        qx, sx, zx = quantize_rows_affine(x)
    else:
        (qx, sx), zx = quantize_rows_symmetric(x), None
    _, sw = quantize_rows_symmetric(w)
    x_hat = dequantize_rows(qx, sx, zx).double()
    return (sx.double()[:, None] / 2) * w.double().abs().sum(1)[None, :] + (
        sw.double()[None, :] / 2
    ) * x_hat.abs().sum(1)[:, None]


@pytest.mark.unit
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("smoothing", [False, True])
def test_forward_error_is_within_the_derived_bound(affine, smoothing):
    x = outlier_inputs(64, 96)
    linear = nn.Linear(96, 40)
    layer = Int8Linear(linear, transposed=False, affine=affine)
    if smoothing:
        layer.act_amax.copy_(x.abs().amax(0))
        layer.smoothing = True
    with torch.no_grad():
        y = layer(x)
        exact = x.double() @ linear.weight.double().t() + linear.bias.double()
        s = layer.smooth_scales()
        xs, ws = (x, linear.weight) if s is None else (x / s, linear.weight * s)
        bound = error_bound(xs.float(), ws.float(), affine)
    err = (y.double() - exact).abs()
    # FP32 rescaling of the exact INT32 sums adds ~1e-6 relative on top of the bound.
    assert (err <= bound * 1.0001 + 1e-5).all()
    rel = (err.norm() / exact.norm()).item()
    assert 1e-4 < rel < 0.02  # it is quantized, and it is close
    assert y.dtype == torch.float32


@pytest.mark.unit
def test_smoothing_lowers_the_error_on_outlier_channels():
    x = outlier_inputs(128, 96)
    linear = nn.Linear(96, 64)
    exact = x.double() @ linear.weight.double().t() + linear.bias.double()
    errors = []
    for smoothing in (False, True):
        layer = Int8Linear(linear, transposed=False, affine=False)
        layer.act_amax.copy_(x.abs().amax(0))
        layer.smoothing = smoothing
        with torch.no_grad():
            errors.append(((layer(x).double() - exact).norm() / exact.norm()).item())
    assert errors[1] < 0.7 * errors[0]


@pytest.mark.unit
def test_gradient_is_the_ste_reference_in_bf16_and_int8_is_saved():
    x = outlier_inputs(48, 64).requires_grad_(True)
    linear = nn.Linear(64, 32)
    layer = Int8Linear(linear, transposed=False, affine=True)
    saved: list[torch.Tensor] = []
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t)
    with hooks, torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    dy = torch.randn(48, 32, generator=torch.Generator().manual_seed(1))
    y.backward(dy.to(torch.bfloat16))

    qx, sx, zx = quantize_rows_affine(x.detach())
    x_hat = dequantize_rows(qx, sx, zx)
    dy16 = dy.to(torch.bfloat16).double()
    w16 = linear.weight.detach().to(torch.bfloat16).double()
    ref_dx = dy16 @ w16  # STE: against the master weights, not their INT8 copy
    ref_dw = dy16.t() @ x_hat.to(torch.bfloat16).double()
    # BF16 products with FP32 sums, rounded to BF16 once: relative error <= 2^-8 per value.
    torch.testing.assert_close(x.grad.double(), ref_dx, rtol=2**-7, atol=1e-3 * ref_dx.abs().max())
    torch.testing.assert_close(
        linear.weight.grad.double(), ref_dw, rtol=2**-7, atol=1e-3 * ref_dw.abs().max()
    )
    torch.testing.assert_close(linear.bias.grad.double(), dy16.sum(0), rtol=1e-6, atol=1e-5)
    assert linear.weight.grad.dtype == torch.float32
    # The input is saved as INT8 with its per-token scales, never in a float dtype.
    big = [t for t in saved if t.numel() == x.numel()]
    assert [t.dtype for t in big] == [torch.int8]
    assert not any(t.is_floating_point() and t.numel() >= x.numel() for t in saved)


@pytest.mark.e2e
def test_default_exclusions_keep_attention_output_and_lm_head_in_bf16(micro, monkeypatch):
    cfg = micro("precision.int8.enabled=true", "precision.compute_dtype=bf16", "train.eval_every=0")
    trainer = build_trainer(cfg, DistEnv())
    model = trainer.backend.model
    calls: list[tuple[int, int]] = []
    real = torch._int_mm
    monkeypatch.setattr(
        torch, "_int_mm", lambda a, b: calls.append((a.shape[1], b.shape[1])) or real(a, b)
    )
    dtypes: dict[str, torch.dtype] = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear | Int8Linear):
            m.register_forward_hook(lambda mod, i, o, name=name: dtypes.__setitem__(name, o.dtype))
    trainer.train_step()
    trainer.callbacks.close()
    int8 = sorted(n for n, m in model.named_modules() if isinstance(m, Int8Linear))
    assert int8 == [
        f"blocks.{i}.{n}"
        for i in (0, 1)
        for n in ("attn.k", "attn.q", "attn.v", "mlp.down", "mlp.up")
    ]
    assert isinstance(model.blocks[0].attn.proj, nn.Linear) and isinstance(model.lm_head, nn.Linear)
    assert model.lm_head.weight is model.tok_emb.weight  # the tie is untouched
    assert dtypes["blocks.0.attn.proj"] == dtypes["lm_head"] == torch.bfloat16
    assert all(dtypes[n] == torch.bfloat16 for n in int8)
    # one INT8 matmul per converted layer: (K, N) of q, k, v, up and down, twice
    assert sorted(calls) == sorted([(64, 64)] * 3 * 2 + [(64, 256), (256, 64)] * 2)
    table = dict((r[0], r[1]) for r in trainer.policy.rows())
    assert table["int8 forward"] == (
        "blocks.*.attn.q, blocks.*.attn.k, blocks.*.attn.v, blocks.*.mlp.up, blocks.*.mlp.down"
    )


@pytest.mark.unit
def test_gpt2_conv1d_is_converted():
    torch.manual_seed(0)
    cfg = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 2, "n_positions": 32}
    cfg.update(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = build_hf(cfg, None, 384)
    ids = torch.randint(0, 384, (4, 32))
    with torch.no_grad():
        reference = model(ids)
    layers = convert_to_int8(model, Int8Config(enabled=True))
    assert sorted(layers) == [
        f"hf.transformer.h.{i}.{n}"
        for i in (0, 1)
        for n in ("attn.c_attn", "mlp.c_fc", "mlp.c_proj")
    ]
    assert all(layer.transposed for layer in layers.values())
    assert type(model.hf.transformer.h[0].attn.c_proj).__name__ == "Conv1D"  # excluded
    logits = model(ids)
    rel = ((logits - reference).norm() / reference.norm()).item()
    assert 0 < rel < 0.02
    logits.float().logsumexp(-1).mean().backward()
    c_fc = model.hf.transformer.h[0].mlp.c_fc
    assert c_fc.weight.grad.shape == c_fc.weight.shape == (64, 256)
    assert c_fc.weight.grad.abs().sum() > 0


@pytest.mark.unit
def test_bad_int8_config_is_a_clear_error(micro):
    with pytest.raises(ConfigError, match="precision.int8.modules"):
        build_trainer(
            micro("precision.int8.enabled=true", "precision.int8.modules=[nothing]"),
            DistEnv(),
        )
    with pytest.raises(ConfigError, match="fp32_modules"):
        build_trainer(
            micro(
                "precision.int8.enabled=true",
                "precision.fp32_modules=['blocks.0']",
                out="b",
            ),
            DistEnv(),
        )
    with pytest.raises(ConfigError, match="precision.int8.activation_scheme"):
        micro("precision.int8.activation_scheme=asym")
    with pytest.raises(ConfigError, match="precision.int8.weight_scheme"):
        micro("precision.int8.weight_scheme=per_tensor")


def calibration_on_ranks(args: list[str]) -> dict:
    trainer = build_trainer(load_config([], args), read_env())
    try:
        trainer.fit()
        cb = next(c for c in trainer.callbacks.items if getattr(c, "state_key", "") == "int8")
        return cb.state_dict()
    finally:
        trainer.callbacks.close()
        shutdown(clean=False)


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("backend", "stage", "stages"), [("fsdp", 0, 1), ("fsdp", 0, 2), ("zero", 2, 1), ("zero", 3, 1)]
)
def test_calibration_is_the_max_over_ranks_and_identical_on_every_rank(
    tmp_path, corpus_files, cache_dir, backend, stage, stages
):
    """Also with pipeline stages: each stage runs copies of its layers; the calibration holds
    every layer's whole vector on every rank (the other stage's from the MAX across ranks)."""
    args = micro_overrides(tmp_path / backend, corpus_files, cache_dir) + [
        f"parallel.backend={backend}",
        f"parallel.pipeline_parallel={stages}",
        f"parallel.zero_stage={stage or 2}",
        "precision.compute_dtype=bf16",
        "precision.int8.enabled=true",
        "precision.int8.calibration_steps=3",
        "train.max_steps=4",
        "train.eval_every=0",
        "checkpoint.every=0",
    ]
    r0, r1 = run_distributed(calibration_on_ranks, 2, args)
    assert r0 == r1 and r0["steps"] == 3
    for block in (0, 1):  # with 2 stages, one on each rank
        amax = r0["act_amax"][f"blocks.{block}.mlp.up"]
        assert len(amax) == 64 and min(amax) > 0


@pytest.mark.e2e
def test_calibration_state_survives_checkpoint_and_resume(micro):
    common = (
        "precision.int8.enabled=true",
        "precision.int8.calibration_steps=3",
        "precision.int8.calibration=ema",
        "precision.int8.ema_decay=0.5",
        "train.max_steps=8",
        "train.eval_every=0",
        "checkpoint.every=4",
    )
    straight = run(micro(*common, out="straight"), DistEnv())
    stopped = micro(*common, "train.stop_at_step=5", out="resumed")
    run(stopped, DistEnv())
    saved = json.loads(
        (Path(stopped.train.out_dir) / "checkpoints/step_00000005/trainer.json").read_text()
    )["callbacks"]["int8"]
    assert saved["steps"] == 5 and len(saved["act_amax"]) == 10  # q, k, v, up, down x 2
    trainer = build_trainer(micro(*common, out="resumed"), DistEnv())
    cb = next(c for c in trainer.callbacks.items if getattr(c, "state_key", "") == "int8")
    trainer.callbacks.close()
    assert cb.state_dict() == saved  # the scales are restored exactly, and smoothing is on
    assert all(layer.smoothing for layer in cb.layers.values())
    resumed = run(micro(*common, out="resumed"), DistEnv())
    # EMA scales change every step: a resume without them would not match bit for bit.
    assert resumed["fingerprint"] == straight["fingerprint"]


def tiny_val_loss(out: str, cache_dir: str, *extra: str) -> float:
    """60 steps of configs/tiny.yaml at micro-batch 8 on one thread (runs in a forked process),
    in the compute dtype the hardware runs fast (`auto`: BF16 where the CPU has it natively, else
    FP32; emulated BF16 takes 20 minutes on a CPU without it)."""
    cfg = load_config(
        [str(ROOT / "configs/tiny.yaml")],
        [
            f"train.out_dir={out}",
            f"data.cache_dir={cache_dir}",
            "train.max_steps=60",
            "train.micro_batch_size=8",
            "train.eval_every=60",
            "train.log_every=30",
            "train.progress=false",
            "train.num_threads=1",
            "checkpoint.every=0",
            "wandb.mode=disabled",
            *extra,
        ],
    )
    run(cfg, DistEnv())
    metrics = (Path(out) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(m) for m in metrics if "val_loss" in m][-1]["val_loss"]


@pytest.mark.e2e
def test_tiny_model_int8_reaches_the_validation_loss_of_the_plain_run(tmp_path, cache_dir):
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # Tokenize once here, then train both variants side by side, one core each.
    from bigtrain.data import prepare_corpus

    prepare_corpus(
        load_config([str(ROOT / "configs/tiny.yaml")], [f"data.cache_dir={cache_dir}"]).data,
    )
    # forked from the suite's preloaded server (tests/distributed.py): torch and bigtrain are
    # imported there once, not in each process
    multiprocessing.set_forkserver_preload(["tests.distributed_preload"])
    forkserver = multiprocessing.get_context("forkserver")
    with ProcessPoolExecutor(2, mp_context=forkserver) as pool:
        plain = pool.submit(tiny_val_loss, str(tmp_path / "plain"), str(cache_dir))
        int8 = pool.submit(
            tiny_val_loss, str(tmp_path / "int8"), str(cache_dir), "precision.int8.enabled=true"
        )
        plain_loss, int8_loss = plain.result(), int8.result()
    assert plain_loss < 6.2  # it learned something (6.74 at the start, ~5.95 here)
    assert abs(int8_loss - plain_loss) / plain_loss < 0.03


@pytest.mark.unit
def test_calibration_of_other_layers_is_refused_with_the_layers_named():
    from bigtrain.callbacks.int8_calibration import Int8Calibration

    layer = Int8Linear(nn.Linear(8, 4), transposed=False, affine=True)
    calibration = Int8Calibration({"blocks.0.mlp.up": layer}, Int8Config(enabled=True))
    saved = {"steps": 3, "act_amax": {"blocks.0.attn.q": [1.0] * 8}}
    with pytest.raises(ConfigError, match=r"covers other layers \(blocks\.\*\.attn\.q\)"):
        calibration.load_state_dict(saved)
    assert calibration.steps == 0 and layer.act_amax.abs().sum() == 0  # nothing half-loaded


@pytest.mark.unit
def test_every_int8_tensor_follows_the_layer_to_another_device():
    """The CPU-side guard for CUDA (a GPU run crashed on a CPU-held calibration buffer): after a
    calibrated state is loaded, moving the model moves every parameter and buffer of each INT8
    layer, a layer converted after the move is born there, and a forward runs on meta inputs."""
    from bigtrain.callbacks.int8_calibration import Int8Calibration
    from bigtrain.config.schema import ModelConfig
    from bigtrain.model import build_model

    cfg = ModelConfig(n_layers=2, n_heads=2, d_model=32, seq_len=16)
    model = build_model(cfg, 64)
    layers = convert_to_int8(model, Int8Config(enabled=True, calibration_steps=2))
    calibration = Int8Calibration(layers, Int8Config(enabled=True, calibration_steps=2))
    saved = {"steps": 2, "act_amax": {n: [1.5] * x.in_features for n, x in layers.items()}}
    calibration.load_state_dict(saved)
    assert all(layer.smoothing for layer in layers.values())
    model.to("meta")
    for name, layer in layers.items():
        tensors = dict(layer.named_parameters()) | dict(layer.named_buffers())
        assert {"weight", "act_amax", "step_amax"} <= set(tensors), name
        for key, tensor in tensors.items():
            assert tensor.device.type == "meta", (name, key)
    model.train()
    logits = model(torch.zeros(2, 16, dtype=torch.long, device="meta"))
    assert logits.device.type == "meta" and logits.shape == (2, 16, 64)
    logits.sum().backward()  # the STE backward on meta, too
    assert all(layer.weight.grad.device.type == "meta" for layer in layers.values())
    later = build_model(cfg, 64).to("meta")  # converted after the move, as bench/int8.py did
    for layer in convert_to_int8(later, Int8Config(enabled=True)).values():
        assert layer.act_amax.device.type == layer.step_amax.device.type == "meta"
