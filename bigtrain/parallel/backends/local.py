"""One process, one device: the reference backend the sharded ones are compared against (with
pipeline stages one process per stage: parallel/pipeline/stage_backends.py)."""

from __future__ import annotations

import torch
from torch import nn

from bigtrain.config.schema import OptimConfig, PrecisionConfig
from bigtrain.parallel.backends.base import weights_fingerprint
from bigtrain.parallel.backends.torch_base import TorchBackend
from bigtrain.precision.policy import PrecisionPolicy
from bigtrain.utils.names import canonical_name


class LocalBackend(TorchBackend):
    name = "local"

    def __init__(
        self,
        model: nn.Module,
        policy: PrecisionPolicy,
        optim: OptimConfig,
        precision: PrecisionConfig,
        device: torch.device,
    ) -> None:
        assert all(p.dtype == policy.master_dtype for p in model.parameters()), (
            "master weights must be built in FP32"
        )
        super().__init__(model.to(device), policy, optim, precision, device)

    def fingerprint(self) -> str:
        return weights_fingerprint(
            (canonical_name(n), lambda p=p: p) for n, p in self.model.named_parameters()
        )
