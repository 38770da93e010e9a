"""What a ZeRO rank holds where, and DeepSpeed's loss-scaler state as numbers.

A `Fragment` is the part of one parameter a rank holds: a range of the flattened parameter at some
place in one of its flat FP32 partitions (one per optimizer parameter group), read from
DeepSpeed's partitioning bookkeeping. ZeroBackend.blocks turns fragments into the boxes of the one
checkpoint format (checkpoint/blocks.py), so ZeRO checkpoints load under any stage, world size
or other backend; `load_from` reads each fragment's range from a source.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Fragment:
    """The part of one parameter a rank holds."""

    name: str  # canonical parameter name
    group: int  # which flat FP32 partition (optimizer parameter group)
    flat_start: int  # where the fragment starts in that partition
    start: int  # where it starts in the flattened parameter
    numel: int
    shape: tuple[int, ...]  # the whole parameter's shape


def local_fragments(
    optimizer, named_params: list[tuple[str, torch.nn.Parameter]], stage: int, rank: int
) -> list[Fragment]:
    """This rank's fragments, from DeepSpeed's partitioning bookkeeping."""
    out = []
    for name, p in named_params:
        if stage == 3:
            # ZeRO-3 pads each parameter to a multiple of the world size and gives rank r the
            # r-th equal slice; the FP32 partition holds the slices of its group back to back.
            group, flat_start, size = optimizer.grad_position[optimizer.get_param_id(p)]
            start = rank * size
            numel = max(0, min(size, p.ds_numel - start))
            out.append(Fragment(name, group, flat_start, start, numel, tuple(p.ds_shape)))
            continue
        mapping = getattr(p, "_hp_mapping", None)  # ZeRO-1/2: None where this rank holds none
        if mapping is not None:
            lp, hp = mapping.lp_fragment_address, mapping.hp_fragment_address
            out.append(
                Fragment(
                    name, mapping.param_group_index, hp.start, lp.start, lp.numel, tuple(p.shape)
                )
            )
    return out


def scaler_state(loss_scaler) -> dict[str, float]:
    """DeepSpeed's dynamic loss scaler's counters (FP16), as numbers."""
    out = {}
    for key in ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis"):
        value = getattr(loss_scaler, key, None)
        if value is not None:
            out[key] = float(value)
    return out


def load_scaler_state(loss_scaler, saved: dict[str, float]) -> None:
    for key, value in saved.items():
        current = getattr(loss_scaler, key, None)
        if torch.is_tensor(current):
            current.fill_(value)
        elif isinstance(current, int):
            setattr(loss_scaler, key, int(value))
        elif current is not None:
            setattr(loss_scaler, key, value)
