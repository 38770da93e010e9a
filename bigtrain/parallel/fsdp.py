"""PyTorch FSDP2: `fully_shard` per transformer block and the root, mixed precision from the policy,
checkpoints through torch.distributed.checkpoint (sharded; resharded on load at another world size)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from bigtrain.config.schema import OptimConfig
from bigtrain.parallel.apply import transformer_blocks
from bigtrain.parallel.backend import TorchBackend, canonical_name, weights_fingerprint
from bigtrain.precision.policy import PrecisionPolicy


def fsdp_mixed_precision(policy: PrecisionPolicy) -> MixedPrecisionPolicy:
    """The policy's FSDP2 form: parameters all-gathered in the compute dtype, gradients
    reduce-scattered in the reduction dtype (FP32), master shards kept FP32."""
    return MixedPrecisionPolicy(
        param_dtype=policy.compute_dtype, reduce_dtype=policy.reduce_dtype, output_dtype=None
    )


class FSDPBackend(TorchBackend):
    name = "fsdp"

    def __init__(
        self,
        model: nn.Module,
        policy: PrecisionPolicy,
        optim: OptimConfig,
        device: torch.device,
        reshard_after_forward: bool = True,
    ) -> None:
        assert dist.is_initialized(), "FSDP2 needs a process group"
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        mp = fsdp_mixed_precision(policy)
        model = model.to(device)
        for block in transformer_blocks(model):
            fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
        # The root holds embeddings, final norm and lm_head (tied weights stay in one group).
        fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
        super().__init__(model, policy, optim, device)

    def autocast(self) -> torch.autocast:
        # FSDP2 casts parameters to the compute dtype itself; autocast would only add casts.
        return torch.autocast(self.device.type, enabled=False)

    def before_backward(self, last_micro_step: bool) -> None:
        # Accumulate unsharded gradients locally; reduce-scatter once, on the last micro-batch.
        self.model.set_requires_gradient_sync(last_micro_step)

    def save(self, directory: Path) -> None:
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(directory / "dcp"))

    def load(self, directory: Path) -> None:
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=str(directory / "dcp"))
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )

    def fingerprint(self) -> str:
        # full_tensor() all-gathers one parameter at a time; every rank walks the same order.
        return weights_fingerprint(
            (canonical_name(n), lambda p=p: p.full_tensor())
            for n, p in self.model.named_parameters()
        )
