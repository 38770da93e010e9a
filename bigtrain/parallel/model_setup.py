"""The model as a backend receives it: built where its backend wants it, with the precision
policy's knobs and INT8 layers applied, not yet wrapped.

Where it is built (`build_site`):
- `partitioned`: ZeRO-3 with bigtrain's GPT, inside deepspeed.zero.Init: each layer is split
  across the ranks as soon as it is built, so no process holds more than its partition and the
  layer being built. Undrawn: ZeroBackend writes the initial values into its FP32 partitions.
- `meta`: FSDP2 with parallel.meta_init, and pipelined GPTs: shapes only; FSDPBackend
  materialises its shards, each pipeline stage its own part (parallelize.py). A pipelined
  transformers model is built whole and cut (transformers initialises it as a whole).
- `whole`: everything else, in every process. bigtrain's GPT is built on the training device and
  drawn there; transformers models on the default device, with transformers' own init.
bigtrain's GPT gets the same initial weights on every site (model/init.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn

from bigtrain.config.schema import Config, Fp8Config, Int8Config, ModelConfig, ParallelConfig
from bigtrain.errors import ConfigError
from bigtrain.model import GPT, architecture_only, build_model, model_flops_per_token, num_params
from bigtrain.parallel.layout import Layout
from bigtrain.parallel.meta_init import uses_meta_init
from bigtrain.precision import PrecisionPolicy, apply_to_model, detect_hardware, resolve_policy
from bigtrain.precision.int8 import Int8Layer, convert_to_int8, int_mm_available
from bigtrain.utils.names import canonical_name


def build_site(p: ParallelConfig, model_kind: str, num_params: int) -> str:
    """`partitioned`, `meta` or `whole` (module docstring)."""
    if p.pipeline_parallel > 1 and model_kind == "gpt":  # each stage draws its own part
        return "meta"
    if p.backend == "zero" and p.zero_stage == 3 and model_kind == "gpt":
        return "partitioned"
    if uses_meta_init(p.meta_init, p.backend, model_kind, num_params):
        return "meta"
    return "whole"


def build(
    model_cfg: ModelConfig,
    seed: int,
    vocab_size: int,
    site: str,
    device: torch.device,
    partitioned: Callable[[Callable[[], nn.Module]], nn.Module] | None = None,
) -> nn.Module:
    """The model, built at `site`; `partitioned`: ZeRO-3's build of it (backends/zero.py)."""
    if site == "partitioned":
        assert partitioned is not None
        return partitioned(lambda: build_model(model_cfg, vocab_size, init_seed=None))
    if site == "meta":
        with torch.device("meta"):
            return build_model(model_cfg, vocab_size, init_seed=None)
    # GPT: drawn on the device the sharded sites draw on (CPU and CUDA generators differ).
    gpt = model_cfg.kind == "gpt"
    with torch.device(device) if gpt else contextlib.nullcontext():
        return build_model(model_cfg, vocab_size, init_seed=seed)


def apply_int8(
    int8: Int8Config, model: nn.Module, policy: PrecisionPolicy, device: torch.device
) -> dict[str, Int8Layer]:
    """Convert the selected linear layers to INT8 forward (before any wrapping or sharding), and
    record their names in the policy's table."""
    if not policy.int8:
        return {}
    int_mm_available(device)
    fp32 = tuple(p for phase in policy.phases for p in phase.fp32_modules)
    layers = convert_to_int8(model, int8, fp32)
    policy.int8_modules = tuple(layers)
    return layers


def fp8_all_gather(fp8: Fp8Config, p: ParallelConfig) -> bool:
    """Whether FSDP2 gathers the FP8 layers' weights in FP8 (precision.fp8.all_gather)."""
    if fp8.all_gather is None:
        return p.backend == "fsdp" and fp8.recipe == "tensorwise"
    if fp8.all_gather and p.backend != "fsdp":
        raise ConfigError(
            f"key 'precision.fp8.all_gather' is true with parallel.backend={p.backend}: the FP8 "
            "all-gather is FSDP2's (parallel.backend=fsdp); set it to false or leave it unset"
        )
    if fp8.all_gather and fp8.recipe != "tensorwise":
        raise ConfigError(
            f"key 'precision.fp8.all_gather' is true with precision.fp8.recipe={fp8.recipe}: "
            "torchao gathers weights in FP8 with one scale per tensor only (recipe tensorwise)"
        )
    return fp8.all_gather


def apply_fp8(
    fp8: Fp8Config, parallel: ParallelConfig, model: nn.Module, policy: PrecisionPolicy
) -> dict[str, nn.Module]:
    """Convert the selected linear layers to FP8 (after INT8, before any wrapping or sharding),
    and record them and the excluded ones, with reasons, in the policy's table."""
    if not policy.fp8:
        return {}
    import importlib.util

    from bigtrain.precision.fp8 import convert_to_fp8

    if policy.fp8_auto and (parallel.backend == "zero" or not importlib.util.find_spec("torchao")):
        why = (
            "parallel.backend=zero"
            if parallel.backend == "zero"
            else "torchao is not installed (pip install 'bigtrain[fp8]')"
        )
        policy.fp8, policy.phases = False, tuple(replace(p, fp8=False) for p in policy.phases)
        policy.reasons["fp8"] = f"auto: would pay here, but {why}"
        return {}
    if parallel.backend == "zero":
        raise ConfigError(
            "precision.fp8.enabled=true with parallel.backend=zero: DeepSpeed casts the whole "
            "model to its compute dtype and runs its own mixed precision, around which torchao's "
            "FP8 casts and scales are not kept; use parallel.backend=fsdp (FP8 all-gather) or local"
        )
    policy.fp8_all_gather = fp8_all_gather(fp8, parallel)
    fp32 = tuple(p for phase in policy.phases for p in phase.fp32_modules)
    layers, excluded = convert_to_fp8(model, fp8, policy.fp8_all_gather, policy.fp8_auto, fp32)
    policy.fp8_modules, policy.fp8_excluded = tuple(layers), excluded
    policy.fp8_share = fp8_share(model, layers)
    return layers


def fp8_share(model: nn.Module, layers: dict[str, nn.Module]) -> float:
    """The share of the model's parameters that FP8 layers hold (their weights)."""
    total = sum(p.numel() for p in model.parameters())
    return sum(layer.weight.numel() for layer in layers.values()) / max(1, total)


@dataclass(frozen=True)
class ModelFacts:
    """What building the model found out."""

    policy: PrecisionPolicy
    num_params: int
    shapes: dict[str, list[int]]  # by canonical name: the whole parameters, on every site
    flops_per_token: float  # from the shapes: a partitioned model holds only its part
    int8_layers: dict[str, Int8Layer]
    fp8_layers: dict[str, nn.Module]  # Fp8Linear by canonical name (precision/fp8.py)
    build_site: str  # partitioned, meta or whole (build_site)


def make_model(
    cfg: Config,
    layout: Layout,
    vocab_size: int,
    device: torch.device,
    eos_id: int | None = None,
) -> tuple[nn.Module, ModelFacts]:
    """The model with its precision policy applied (not yet wrapped), and what building it found
    out (ModelFacts)."""
    with torch.random.fork_rng(), torch.device("meta"):  # shapes only: decide how to build
        shaped = build_model(architecture_only(cfg.model), vocab_size, init_seed=None)
    n_params = num_params(shaped)
    policy = resolve_policy(cfg.precision, detect_hardware(device), n_params)
    site = build_site(cfg.parallel, cfg.model.kind, n_params)
    zero3 = None
    if site == "partitioned":  # inside deepspeed.zero.Init with the run's DeepSpeed config
        from bigtrain.parallel.backends.zero import build_partitioned, deepspeed_config

        ds_config = deepspeed_config(cfg, policy, layout)
        zero3 = lambda build_fn: build_partitioned(build_fn, ds_config, policy)  # noqa: E731
    model = build(cfg.model, cfg.train.seed, vocab_size, site, device, zero3)
    apply_to_model(model, policy)
    if cfg.data.document_mask:
        if not isinstance(model, GPT):
            raise ConfigError(
                "data.document_mask=true needs model.kind=gpt (bigtrain's GPT builds the "
                "per-document mask and positions from the EOS tokens)"
            )
        model.document_eos = eos_id
    int8_layers = apply_int8(cfg.precision.int8, model, policy, device)
    return model, ModelFacts(
        policy=policy,
        num_params=n_params,
        shapes={canonical_name(n): list(p.shape) for n, p in shaped.named_parameters()},
        flops_per_token=model_flops_per_token(shaped, cfg.model),
        int8_layers=int8_layers,
        fp8_layers=apply_fp8(cfg.precision.fp8, cfg.parallel, model, policy),
        build_site=site,
    )
