"""ZeRO checkpoints in a layout that does not depend on the partitioning.

Each rank writes `zero/rank_<r>.safetensors`: its FP32 master partitions and the optimizer's FP32
moments of them (one tensor per parameter group), plus in the header a table of fragments: which
slice of which parameter (by canonical name, as a range of the flattened parameter) lies where in
those partitions. Loading reads the tables of every rank's file and copies, for each fragment this
rank holds now, the overlapping slices of the saved ones (safetensors reads just those ranges). So
a checkpoint written by ZeRO-1, 2 or 3 at one world size resumes under any ZeRO stage at any world
size, and nothing is unpickled: DeepSpeed's own engine files are not used.

Loading goes through `parallel.sources.ZeroSource`, which reads any parameter's slice from these
files, so the same code loads them into FSDP2 or the local backend too.

Rank 0 also writes `zero/buffers.safetensors` (the model's persistent buffers). The header holds
the step counts, DeepSpeed's loss-scaler state (FP16) and the engine's counters.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from bigtrain.errors import ConfigError
from bigtrain.optim.optimizer import MOMENTS

FORMAT = "bigtrain-zero-1"


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


def write_rank_file(
    path: Path,
    fragments: list[Fragment],
    flats: list[torch.Tensor],
    moments: list[dict[str, torch.Tensor] | None],
    header: dict[str, Any],
) -> None:
    """flats: this rank's FP32 partitions (host copies); moments: per partition the FP32
    exp_avg/exp_avg_sq (None before the first step)."""
    tensors = {}
    for i, flat in enumerate(flats):
        tensors[f"group{i}.fp32"] = flat
        for key in MOMENTS:
            if moments[i] is not None:
                tensors[f"group{i}.{key}"] = moments[i][key]
    meta = {
        "format": FORMAT,
        "fragments": json.dumps([asdict(f) for f in fragments if f.numel]),
        "header": json.dumps(header),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=meta)


@dataclass
class SavedFragment:
    file: Path
    group: int
    flat_start: int
    start: int
    numel: int
    shape: tuple[int, ...]


def read_index(directory: Path) -> tuple[dict[str, list[SavedFragment]], dict[str, Any]]:
    """Every saved fragment by parameter name, and rank 0's header."""
    files = sorted((directory / "zero").glob("rank_*.safetensors"))
    if not files:
        raise ConfigError(f"checkpoint '{directory}' has no zero/rank_*.safetensors files")
    index: dict[str, list[SavedFragment]] = {}
    header: dict[str, Any] = {}
    for file in files:
        with safe_open(str(file), "pt") as f:
            meta = f.metadata() or {}
        if meta.get("format") != FORMAT:
            raise ConfigError(f"checkpoint file '{file}': not a {FORMAT} file")
        for frag in json.loads(meta["fragments"]):
            index.setdefault(frag["name"], []).append(
                SavedFragment(
                    file,
                    frag["group"],
                    frag["flat_start"],
                    frag["start"],
                    frag["numel"],
                    tuple(frag["shape"]),
                )
            )
        if file.name == "rank_00000.safetensors":
            header = json.loads(meta["header"])
    return index, header


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
