"""Tensor parallelism from outside the model: `parallelize_module` over the mesh's tp axis, from
`parallel.tp_plan` (module name patterns inside a transformer block -> colwise/rowwise).

A colwise layer splits its output features (each tp rank computes its heads of q, k, v or its
part of the MLP's hidden units) and returns the local part; the rowwise layer after it splits its
input features the same way and all-reduces the output. Everything else (embeddings, norms,
lm_head) is left whole on every tp rank and sharded by FSDP2 over the shard axis; its gradients
come out equal on the tp ranks (the rowwise all-reduce makes the activations, and the colwise
backward the input gradients, whole). transformers' attention reshapes to `(-1, head_dim)`, so
a q/k/v layer split by heads needs no change; the kv heads must divide by the tp degree.
"""

from __future__ import annotations

import fnmatch

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from bigtrain.errors import ConfigError
from bigtrain.parallel.apply import transformer_blocks

STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def block_plan(block: nn.Module, patterns: dict[str, str]) -> dict[str, str]:
    """The block's Linear layers that match a pattern, by name -> style (first match wins)."""
    plan = {}
    for name, module in block.named_modules():
        style = next((s for p, s in patterns.items() if fnmatch.fnmatchcase(name, p)), None)
        if style is not None and isinstance(module, nn.Linear):
            plan[name] = style
    return plan


def check_divisible(model: nn.Module, tp: int) -> None:
    """Heads and kv heads split whole over the tp ranks (transformers' config names)."""
    config = getattr(getattr(model, "hf", None), "config", None)
    for key in ("num_attention_heads", "num_key_value_heads"):
        value = getattr(config, key, None)
        if value is not None and value % tp:
            raise ConfigError(
                f"key 'parallel.tensor_parallel' ({tp}) must divide the model's {key} ({value}): "
                "each tp rank computes whole heads"
            )


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, patterns: dict[str, str]) -> None:
    """Split each transformer block's matched Linear layers over `tp_mesh` (in place)."""
    check_divisible(model, tp_mesh.size())
    blocks = transformer_blocks(model)
    plan = block_plan(blocks[0], patterns)
    styles = set(plan.values())
    if styles != {"colwise", "rowwise"}:
        raise ConfigError(
            f"key 'parallel.tp_plan' ({patterns}) matched {plan or 'no Linear layers'} in "
            f"{type(blocks[0]).__name__}; it needs colwise layers and the rowwise ones after them "
            f"(names in a block: {[n for n, m in blocks[0].named_modules() if isinstance(m, nn.Linear)]})"
        )
    for block in blocks:
        parallelize_module(block, tp_mesh, {name: STYLES[s]() for name, s in plan.items()})
