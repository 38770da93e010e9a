"""PyTorch FSDP2's backend: the step of a model that parallelize.py sharded (`fully_shard` per
transformer block and the root, mixed precision from the policy: fsdp_mixed_precision), and
checkpoints in the one format of every backend (each rank its shards, checkpoint/state.py)."""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor.parallel import loss_parallel

from bigtrain.config.schema import OptimConfig, PrecisionConfig
from bigtrain.parallel.backends.base import weights_fingerprint
from bigtrain.parallel.backends.torch_base import TorchBackend
from bigtrain.parallel.layout import Layout
from bigtrain.parallel.tensor.plans import dropout_seed, uses_gpt_plan
from bigtrain.precision.policy import PrecisionPolicy
from bigtrain.utils.names import canonical_name


def gathers_in_compute_dtype(policy: PrecisionPolicy) -> bool:
    """One phase and no FP32 modules: FSDP2 all-gathers parameters in the compute dtype (half the
    traffic) and casts once. A precision schedule or FP32 modules need the FP32 weights at compute
    time, so then FSDP2 gathers FP32 and autocast picks each op's dtype, phase by phase."""
    return len(policy.phases) == 1 and not policy.fp32_modules


def fsdp_mixed_precision(policy: PrecisionPolicy) -> MixedPrecisionPolicy:
    """The policy's FSDP2 form: parameters all-gathered in the compute dtype (or FP32, see
    gathers_in_compute_dtype), gradients reduce-scattered in FP32, master shards kept FP32."""
    param_dtype = policy.compute_dtype if gathers_in_compute_dtype(policy) else torch.float32
    return MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=policy.reduce_dtype, output_dtype=None
    )


class FSDPBackend(TorchBackend):
    name = "fsdp"

    def __init__(
        self,
        model: nn.Module,
        policy: PrecisionPolicy,
        optim: OptimConfig,
        precision: PrecisionConfig,
        device: torch.device,
        layout: Layout,
        seed: int,
    ) -> None:
        """`model`: fully sharded already, on the layout's mesh (parallelize.py); `seed`:
        train.seed, from which each tp rank's dropout seed is derived."""
        self.layout = layout
        # bigtrain's GPT under tensor parallelism leaves its logits split by vocabulary
        self.logits_split_by_vocab = layout.tp > 1 and uses_gpt_plan(model)
        self.seed = seed
        # With compute-dtype gathers FSDP2 casts the weights itself; autocast would only add casts.
        self.uses_autocast = not gathers_in_compute_dtype(policy)
        super().__init__(model, policy, optim, precision, device)

    def borrowed_rng(self, step: int) -> None:
        if self.logits_split_by_vocab:  # the GPT plan: each tp rank its own dropout masks
            torch.manual_seed(dropout_seed(self.seed, self.layout.rank, step))

    def loss_context(self) -> contextlib.AbstractContextManager:
        """The cross-entropy over logits split by vocabulary: each tp rank reduces its part
        (max, sum of exponentials, target logit), never gathering the whole vocabulary."""
        return loss_parallel() if self.logits_split_by_vocab else contextlib.nullcontext()

    def before_backward(self, last_micro_step: bool) -> None:
        # Accumulate unsharded gradients locally; reduce-scatter once, on the last micro-batch.
        self.model.set_requires_gradient_sync(last_micro_step)

    def fingerprint(self) -> str:
        # full_tensor() all-gathers one parameter at a time; every rank walks the same order.
        return weights_fingerprint(
            (canonical_name(n), lambda p=p: p.full_tensor())
            for n, p in self.model.named_parameters()
        )
