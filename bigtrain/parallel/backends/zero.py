"""DeepSpeed ZeRO stage 1/2/3 behind the backend protocol.

The DeepSpeed config is generated from bigtrain's config (`deepspeed_config`), so users never
keep two configs in step. The optimizer is bigtrain's (a client optimizer: DeepSpeed hands it the
flat FP32 partitions), which is how the low-precision-state AdamW will plug in: DeepSpeed has no
config key for the optimizer state dtype.

Mixed precision maps onto DeepSpeed's own scheme: with BF16 compute the module's parameters are
BF16 copies, the FP32 master weights live in the ZeRO optimizer's partitions, gradients are
accumulated and reduced in FP32 (`data_types.grad_accum_dtype`, `communication_data_type`).
Clipping uses the norm from the monitor's statistics of the local gradient partitions: bigtrain
scales the partitions before DeepSpeed's step, with DeepSpeed's own clipping off.

Initial weights: ZeRO-3 builds bigtrain's GPT inside deepspeed.zero.Init (`build_partitioned`),
so no process ever holds more than its partition and the layer being built. On every stage, the
exact FP32 initial values are then loaded into the FP32 master partitions, one parameter at a
time (checkpoint/sources.py InitialValues, model/init.py), and the compute copies refreshed
from them: the weights are those of every other backend at any world size, not rounded to the compute dtype.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from bigtrain.checkpoint.blocks import range_views
from bigtrain.checkpoint.sources import InitialValues
from bigtrain.checkpoint.state import Block
from bigtrain.config.schema import Config
from bigtrain.errors import AbortRun, ConfigError
from bigtrain.model.loss import lm_loss
from bigtrain.model.moe import aux_grad_scale
from bigtrain.optim.optimizer import (
    MOMENTS,
    adamw_param_groups,
    make_adamw,
    set_fp32_optimizer_state,
)
from bigtrain.parallel.backends import zero_state
from bigtrain.parallel.backends.base import (
    Backend,
    load_buffers,
    scale_to_norm,
    weights_fingerprint,
)
from bigtrain.parallel.layout import Layout
from bigtrain.precision.policy import Phase, PrecisionPolicy, dtype_name
from bigtrain.precision.scaler import ScaleUpdate
from bigtrain.utils.names import canonical_name
from bigtrain.utils.tensors import full_shape

ENGINE_COUNTERS = ("global_steps", "global_samples", "skipped_steps")


def deepspeed_config(cfg: Config, policy: PrecisionPolicy, layout: Layout) -> dict[str, Any]:
    """The DeepSpeed config dict for this run, derived from bigtrain's config, policy and layout
    (every rank is a data-parallel rank under ZeRO)."""
    t = cfg.train
    ds: dict[str, Any] = {
        "train_batch_size": layout.global_batch(t.micro_batch_size, t.grad_accum_steps),
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.grad_accum_steps,
        "gradient_clipping": 0.0,  # bigtrain clips with the monitor's norm (ZeroBackend.clip_grads)
        "zero_optimization": {"stage": cfg.parallel.zero_stage},
        # bigtrain's AdamW is a client optimizer; ZeRO accepts it only with this switch.
        "zero_allow_untested_optimizer": True,
        "communication_data_type": dtype_name(policy.reduce_dtype),
        "data_types": {"grad_accum_dtype": dtype_name(policy.reduce_dtype)},
        "steps_per_print": 2**62,  # bigtrain logs; keep DeepSpeed's own step log quiet
        "wall_clock_breakdown": False,
    }
    stage = cfg.parallel.zero_stage
    if stage == 2 or (stage == 1 and policy.compute_dtype != torch.bfloat16):
        # The monitor has the norm already; DeepSpeed's would be a second pass over the gradients.
        # (ZeRO-3 and ZeRO-1's BF16 optimizer always compute it.)
        ds["zero_optimization"]["compute_grad_norm"] = False
    if policy.compute_dtype == torch.bfloat16:
        # check_grad_overflow: a non-finite gradient discards the step (bigtrain's skip relies on it).
        ds["bf16"] = {"enabled": True, "check_grad_overflow": True}
    elif policy.compute_dtype == torch.float16:
        p = cfg.precision
        dynamic = policy.loss_scaling == "dynamic"
        ds["fp16"] = {
            "enabled": True,
            "loss_scale": 0 if dynamic else p.loss_scale,  # 0 means dynamic in DeepSpeed
            "initial_scale_power": int(math.log2(p.loss_scale)),
            "loss_scale_window": p.loss_scale_growth_interval,
            "hysteresis": p.loss_scale_hysteresis,
            "min_loss_scale": p.loss_scale_min,
        }
    return ds


def check_zero_precision(policy: PrecisionPolicy) -> None:
    """What the ZeRO backend cannot do, as config errors naming the key and the reason."""
    if len(policy.phases) > 1:
        raise ConfigError(
            "precision.schedule is not supported with parallel.backend=zero: DeepSpeed casts the module to "
            "one compute dtype at initialize and builds its FP32 partitions from it; use fsdp or local"
        )
    if policy.fp32_modules:
        raise ConfigError(
            "precision.fp32_modules is not supported with parallel.backend=zero: DeepSpeed keeps every "
            "module's compute copy in the compute dtype; use fsdp or local"
        )
    if policy.loss_scaling != "none" and policy.compute_dtype != torch.float16:
        raise ConfigError(
            "precision.loss_scaling with parallel.backend=zero applies to fp16 compute only"
        )


def check_accelerator_dtype(compute_dtype: torch.dtype) -> None:
    """DeepSpeed refuses FP16/BF16 where its accelerator lacks them (its CPU accelerator: FP16
    only on CPUs with AVX512-FP16 or AMX); say so as a config error, not its ValueError."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    supported = {
        torch.float16: accelerator.is_fp16_supported,
        torch.bfloat16: accelerator.is_bf16_supported,
    }.get(compute_dtype)
    if supported is not None and not supported():
        raise ConfigError(
            f"precision.compute_dtype={dtype_name(compute_dtype)} with parallel.backend=zero: "
            f"DeepSpeed's {accelerator.device_name()} accelerator does not support "
            f"{dtype_name(compute_dtype)} on this machine; use another compute dtype, or "
            "parallel.backend=fsdp"
        )


def build_partitioned(
    build: Callable[[], nn.Module], config: dict[str, Any], policy: PrecisionPolicy
) -> nn.Module:
    """ZeRO-3: `build()` inside deepspeed.zero.Init with this run's DeepSpeed config (`config`,
    deepspeed_config's), which partitions each layer across the ranks as soon as it is built. Its
    values are placeholders (build draws nothing): ZeroBackend writes the exact ones into its FP32
    master partitions."""
    import deepspeed

    check_zero_precision(policy)
    check_accelerator_dtype(policy.compute_dtype)
    quiet_deprecated_collectives()
    deepspeed.init_distributed(dist_backend=dist.get_backend())  # adopts the existing group
    # zero.Init takes its dtype from the config (the compute dtype), as the engine expects the
    # partitions; the FP32 masters are made at initialize and then written exactly.
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = build()
    # zero.Init also cast the buffers made inside it (rotary tables: arange and all).
    init_buffers = getattr(model, "init_buffers", None)
    if init_buffers is not None:
        init_buffers()
    return model


DEPRECATED_COLLECTIVES = (
    r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"
)
"""What torch says of the collectives DeepSpeed's ZeRO calls (8 FutureWarnings per rank and run,
with source lines): DeepSpeed's to change, not the user's; silenced by message, for ZeRO runs."""


def quiet_deprecated_collectives() -> None:
    warnings.filterwarnings("ignore", message=DEPRECATED_COLLECTIVES, category=FutureWarning)


def is_partitioned(model: nn.Module) -> bool:
    """Built inside zero.Init: DeepSpeed marks its parameters with ids."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


class ZeroBackend(Backend):
    name = "zero"
    state_key, state_label = "fp32", "fp32_partition"

    def __init__(
        self,
        model: nn.Module,
        policy: PrecisionPolicy,
        cfg: Config,
        device: torch.device,
        layout: Layout,
    ) -> None:
        import deepspeed

        check_zero_precision(policy)
        check_accelerator_dtype(policy.compute_dtype)
        quiet_deprecated_collectives()
        deepspeed.init_distributed(dist_backend=dist.get_backend())  # adopts the existing group
        self.policy, self.device, self.stage = policy, device, cfg.parallel.zero_stage
        self.layout = layout
        assert is_partitioned(model) == (self.stage == 3 and hasattr(model, "init_value")), (
            "ZeRO-3 builds bigtrain's GPT partitioned (model_setup.py), everything else whole"
        )
        if not is_partitioned(model):
            model = model.to(device)
        initial = InitialValues(model, cfg.train.seed, device)  # before DeepSpeed recasts it
        groups = adamw_param_groups(model, cfg.optim.weight_decay)
        rounding = cfg.precision.optimizer_state_rounding
        optimizer = make_adamw(groups, cfg.optim, policy, device, rounding)
        self.ds_config = deepspeed_config(cfg, policy, layout)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=self.ds_config
        )
        self.model = self.engine.module
        self._params = [
            (canonical_name(n), p) for n, p in self.model.named_parameters() if p.requires_grad
        ]
        self._empty = torch.empty(0, device=device)
        self.fragments = zero_state.local_fragments(
            self.optimizer, self._params, self.stage, layout.rank
        )
        self._last_scale = self.loss_scale()
        self._min_scale = cfg.precision.loss_scale_min
        # DeepSpeed made the FP32 masters from the compute-dtype module (placeholders on ZeRO-3;
        # rounded to BF16/FP16 otherwise): write the exact initial values, then the copies.
        self.load_from(initial, optimizer=False)

    def set_phase(self, phase: Phase) -> None:
        assert phase.compute_dtype == self.policy.compute_dtype, (
            "check_zero_precision allows one phase"
        )

    def loss_scale(self) -> float | None:
        return (
            float(self.optimizer.loss_scale) if self.policy.compute_dtype == torch.float16 else None
        )

    def adopt_loss_scale(self, scale: float) -> None:
        scaler = getattr(self.optimizer, "loss_scaler", None)
        if scaler is not None and self.policy.compute_dtype == torch.float16:
            zero_state.load_scaler_state(scaler, {"cur_scale": scale})
            self._last_scale = scale

    def update_loss_scale(self, overflow: bool) -> ScaleUpdate | None:
        """DeepSpeed's scaler already reacted inside engine.step(); report where it stands."""
        scale = self.loss_scale()
        if scale is None:
            return None
        previous, self._last_scale = self._last_scale, scale
        changed = "backoff" if scale < previous else "growth" if scale > previous else ""
        return ScaleUpdate(scale, overflow, changed=changed)

    def forward_backward(
        self, inputs: torch.Tensor, targets: torch.Tensor, micro_step: int, num_micro_steps: int
    ) -> torch.Tensor:
        assert num_micro_steps == self.ds_config["gradient_accumulation_steps"]
        # DeepSpeed scales the loss and divides it by gradient_accumulation_steps itself; the MoE
        # losses (model/moe.py) get the same factor.
        with aux_grad_scale(self.model, (self.loss_scale() or 1.0) / num_micro_steps):
            loss = lm_loss(self.engine(inputs), targets)
            self.engine.backward(loss)
        if micro_step < num_micro_steps - 1:
            self.engine.step()  # not a boundary: DeepSpeed only counts the micro-step
        return loss.detach()

    def eval_logits(self, inputs: torch.Tensor) -> torch.Tensor:
        self.engine.eval()
        try:
            return self.engine(inputs)
        finally:
            self.engine.train()

    def named_grads(self) -> list[tuple[str, torch.Tensor]]:
        """This rank's partition of each gradient after the boundary backward (no communication);
        an empty tensor for parameters this rank holds no part of."""
        from deepspeed.utils import safe_get_local_grad

        out = []
        for name, p in self._params:
            grad = None
            if self.stage == 3:
                grad = safe_get_local_grad(p)
            elif getattr(p, "_hp_mapping", None) is not None:
                mapping = p._hp_mapping
                grad = mapping.get_lp_grad_fragment(p._index_in_param_group)
                address = mapping.lp_fragment_address
                if grad.numel() == p.numel() and address.numel != p.numel():
                    # A full-size accumulation buffer: only this rank's fragment counts.
                    grad = grad.flatten().narrow(0, address.start, address.numel)
            out.append((name, grad if grad is not None else self._empty))
        return out

    def unscale_grads(self) -> float:
        return self.loss_scale() or 1.0  # DeepSpeed unscales inside its step

    @torch.no_grad()
    def clip_grads(self, max_norm: float, total_norm: torch.Tensor) -> None:
        # DeepSpeed's own clipping is off (gradient_clipping 0 in deepspeed_config): it would take
        # a second pass over the gradients for a norm the monitor already has. Scaling the local
        # partitions in place is what DeepSpeed's clip does; the loss scale is unaffected.
        if max_norm > 0:
            scale_to_norm([g for _, g in self.named_grads()], max_norm, total_norm)

    def _set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self, lr: float) -> None:
        self._set_lr(lr)
        skipped = self.engine.skipped_steps
        self.engine.step()
        assert self.engine.skipped_steps == skipped, (
            "DeepSpeed skipped a step that bigtrain found finite"
        )

    def skip_step(self) -> None:
        # DeepSpeed has no public "discard these gradients"; its overflow path does exactly that
        # for non-finite gradients. A non-finite loss with finite gradients is made to look the same.
        scale = self.loss_scale()
        if scale is not None and scale <= self._min_scale:
            # DeepSpeed would raise at its minimum scale; bigtrain reports the anomaly instead.
            raise AbortRun(
                f"FP16 overflow at the minimum loss scale {scale} (precision.loss_scale_min)"
            )
        grads = [g for _, g in self.named_grads() if g.numel()]
        if grads:
            grads[0].view(-1)[0] = float("nan")
        # ZeRO-1/2 look for non-finite gradients only with FP16/BF16 (DeepSpeed >= 0.19 turns the
        # check off for FP32); ZeRO-3 always finds them through its norm. Ask for the check here.
        check = getattr(self.optimizer, "check_grad_overflow", None)
        if check is not None:
            self.optimizer.check_grad_overflow = True
        skipped = self.engine.skipped_steps
        try:
            self.engine.step()
        finally:
            if check is not None:
                self.optimizer.check_grad_overflow = check
        assert self.engine.skipped_steps == skipped + 1, (
            "DeepSpeed applied a step that bigtrain skipped"
        )

    # Checkpoints: the base class saves and loads the one format from `blocks`; the engine's
    # counters and DeepSpeed's loss scaler travel in backend.json (extra_state).
    @property
    def base_optimizer(self) -> torch.optim.Optimizer:
        return self.optimizer.optimizer  # the client AdamW, keyed by the flat partitions

    def blocks(self, index: int, tensor: torch.Tensor) -> list[Block]:
        """The boxes of each fragment of flat partition `index` (at most three per dimension)."""
        out = []
        for frag in self.fragments:
            if frag.group == index and frag.numel:
                flat = tensor.view(-1)[frag.flat_start : frag.flat_start + frag.numel]
                for offset, view in range_views(frag.shape, flat, frag.start):
                    out.append((frag.name, frag.shape, offset, view))
        return out

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(full_shape(p)) for name, p in self._params}

    def reset_optimizer_state(self, master: torch.Tensor) -> None:
        self.optimizer.optimizer.state.pop(master, None)

    def extra_state(self) -> dict[str, Any]:
        return {
            "engine": {k: int(getattr(self.engine, k)) for k in ENGINE_COUNTERS},
            "loss_scaler": zero_state.scaler_state(getattr(self.optimizer, "loss_scaler", None)),
        }

    def load_extra_state(self, saved: dict[str, Any]) -> None:
        for key, value in saved["engine"].items():
            setattr(self.engine, key, value)
        if saved["loss_scaler"] and getattr(self.optimizer, "loss_scaler", None) is not None:
            zero_state.load_scaler_state(self.optimizer.loss_scaler, saved["loss_scaler"])
            self._last_scale = self.loss_scale()

    @torch.no_grad()
    def load_from(self, source: Any, optimizer: bool) -> None:
        """Each fragment this rank holds, read from the source (ZeRO checkpoints of any stage and
        world size, other backends' checkpoints, Hugging Face weights); moments per flat
        partition, which holds one parameter group (its step count: any of its parameters')."""
        shapes = {
            name: tuple(p.ds_shape if self.stage == 3 else p.shape) for name, p in self._params
        }
        source.check_covers(shapes)
        flats = self._fp32_flats()
        # Two partition-sized buffers: only when there are moments to read.
        moments = {k: [torch.zeros_like(f) for f in flats] for k in MOMENTS} if optimizer else {}
        steps = [0.0] * len(flats)
        for frag in self.fragments:
            if not frag.numel:  # ZeRO-3's padding: nothing of this parameter here
                continue
            end = frag.start + frag.numel
            at = slice(frag.flat_start, frag.flat_start + frag.numel)
            flats[frag.group][at].copy_(source.read(frag.name, "param", frag.start, end))
            if optimizer and source.step(frag.name):
                steps[frag.group] = source.step(frag.name)
                for key in MOMENTS:
                    moments[key][frag.group][at].copy_(source.read(frag.name, key, frag.start, end))
        base = self.optimizer.optimizer
        for i, flat in enumerate(flats):
            if steps[i]:
                set_fp32_optimizer_state(base, flat, steps[i], {k: moments[k][i] for k in MOMENTS})
            else:
                base.state.pop(flat, None)
        load_buffers(self.model, source)
        self._refresh_compute_copies()

    def fingerprint(self) -> str:
        from deepspeed.utils import safe_get_full_fp32_param

        return weights_fingerprint(
            (name, lambda p=p: safe_get_full_fp32_param(p)) for name, p in self._params
        )

    # Snapshots copy this rank's FP32 partitions and the client optimizer's moments, and restore
    # them in place. DeepSpeed's load_state_dict wants every rank's state (it re-partitions), so
    # this goes through the ZeRO optimizer's flat partitions instead (internals, pinned by tests).
    def _fp32_flats(self) -> list[torch.Tensor]:
        if self.stage == 3:
            return list(self.optimizer.fp32_partitioned_groups_flat)
        if hasattr(self.optimizer, "fp32_groups_flat_partition"):  # ZeRO-1 with BF16 compute
            return list(self.optimizer.fp32_groups_flat_partition)  # (DeepSpeed's BF16_Optimizer)
        return list(self.optimizer.single_partition_of_fp32_groups)

    def master_state(self) -> tuple[list[torch.Tensor], dict]:
        return self._fp32_flats(), self.optimizer.optimizer.state  # the client AdamW's

    def after_load_local_state(self) -> None:
        self._refresh_compute_copies()

    def _refresh_compute_copies(self) -> None:
        """The module's compute-dtype parameters from the FP32 master partitions (and all-gathered
        where ZeRO-1/2 keep them whole)."""
        if self.stage == 3:
            from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

            # Small ("persistent") parameters stay gathered between steps, and a gather skips
            # what is gathered already: drop those copies (no write-back), gather them anew.
            gathered = [
                p
                for p in self.optimizer.persistent_parameters
                if p.ds_status == ZeroParamStatus.AVAILABLE
            ]
            if gathered:
                gathered[0].partition(gathered)
            for i in range(len(self.optimizer.fp32_partitioned_groups_flat)):
                self.optimizer._reassign_or_swap_out_partitioned_parameters(i)
            if gathered:
                gathered[0].all_gather(gathered)
        else:
            self.optimizer.update_lp_params()
