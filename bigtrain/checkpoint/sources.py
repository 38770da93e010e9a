"""Read model weights by canonical parameter name from what is not a bigtrain checkpoint.

A source answers `read(name, key, start, stop)`: elements [start, stop) of the flattened FP32
tensor `key` ("param", "exp_avg", "exp_avg_sq") of parameter `name`. A backend's `load_from`
asks for exactly the slices it keeps (an FSDP2 shard's rows, a ZeRO fragment), so no process holds
the whole model:

- `InitialValues`: a model's exact FP32 initial values, made one parameter at a time.
- `HFSource`: a transformers directory (safetensors, sharded or not) through the name and mapping
  mapping of model/hf_mapping.py (GPT-2's q/k/v in one c_attn, transposed Conv1D weights), sliced.

bigtrain's own checkpoints load through DCP (checkpoint/state.py); `CheckpointReader` there is a
source too (whole tensors, for export and generation), and checkpoint/legacy.py reads the
formats of earlier versions for `bigtrain ckpt convert`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from bigtrain.errors import ConfigError
from bigtrain.model.hf_mapping import Part, hf_rows
from bigtrain.model.init import initial_value
from bigtrain.utils.names import canonical_name
from bigtrain.utils.tensors import full_shape


def check_covers(
    origin: str, have: dict[str, tuple[int, ...]], want: dict[str, tuple[int, ...]]
) -> None:
    """Every tensor of `want` (a model's shapes by canonical name) is in `have` (a source's),
    with its shape; ConfigError naming what is missing or differs otherwise."""
    missing = sorted(set(want) - set(have))
    wrong = [
        f"{n} {list(have[n])} there, {list(s)} in this model"
        for n, s in sorted(want.items())
        if n in have and tuple(have[n]) != tuple(s)
    ]
    if missing or wrong:
        raise ConfigError(
            f"{origin}: does not fit this model (missing {missing[:5]}"
            + (f"; other shapes: {'; '.join(wrong[:4])}" if wrong else "")
            + ")"
        )


class Source:
    """Base: `shapes` of the parameters it holds, by canonical name; subclasses implement read."""

    origin: str  # what it is, for messages and events
    shapes: dict[str, tuple[int, ...]]
    has_optimizer = False

    def read(self, name: str, key: str, start: int, stop: int) -> torch.Tensor:
        raise NotImplementedError

    def full(self, name: str, key: str = "param") -> torch.Tensor:
        shape = self.shapes[name]
        return self.read(name, key, 0, math.prod(shape)).view(shape)

    def block(
        self, name: str, key: str, offset: tuple[int, ...], shape: tuple[int, ...]
    ) -> torch.Tensor:
        """The block of `shape` at `offset` (a tensor-parallel or FSDP2 shard): whole rows of
        dim 0 are read, other dims are then narrowed."""
        full_shape = self.shapes[name]
        if not full_shape:
            return self.read(name, key, 0, 1).view(())
        row = math.prod(full_shape[1:])
        rows = self.read(name, key, offset[0] * row, (offset[0] + shape[0]) * row)
        out = rows.view(shape[0], *full_shape[1:])
        for dim in range(1, len(shape)):
            out = out.narrow(dim, offset[dim], shape[dim])
        return out

    def step(self, name: str) -> float:
        """The optimizer's step count of parameter `name` (0 without optimizer state)."""
        return 0.0

    def buffer(self, name: str) -> torch.Tensor | None:
        """A persistent buffer (INT8 calibration state) by canonical name; None if not here."""
        return self.full(name) if name in self.shapes else None

    def extra_buffers(self) -> dict[str, torch.Tensor]:
        """Persistent buffers kept apart from `shapes` (ZeRO's buffers file)."""
        return {}

    def loss_scale(self) -> float | None:
        """A loss scale kept with the tensors (DeepSpeed's FP16 scaler); None otherwise."""
        return None

    def check_covers(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """Every parameter of a model with `shapes` is here, with its shape."""
        check_covers(self.origin, self.shapes, shapes)


class InitialValues(Source):
    """A model's exact FP32 initial values. bigtrain's GPT draws each parameter when it is read
    (model/init.py), built whole or partitioned; any other model (transformers) was built whole,
    and the FP32 tensors it was built with are kept by reference (no copy) to be read: DeepSpeed
    replaces the module's parameters with compute-dtype copies. No optimizer state, no buffers."""

    def __init__(self, model: torch.nn.Module, seed: int, device: torch.device) -> None:
        self.origin = "the initial weights"
        named = [(canonical_name(n), p) for n, p in model.named_parameters()]
        self.shapes = {name: tuple(full_shape(p)) for name, p in named}
        self.model, self.seed, self.device = model, seed, device
        self.kept = None if hasattr(model, "init_value") else {n: p.detach() for n, p in named}

    def read(self, name: str, key: str, start: int, stop: int) -> torch.Tensor:
        assert key == "param", "initial values hold no optimizer state"
        if self.kept is not None:
            return self.kept[name].reshape(-1)[start:stop]
        full = initial_value(
            self.model, name, torch.Size(self.shapes[name]), self.device, self.seed
        )
        return full.reshape(-1)[start:stop]  # a view: the whole value lives until it is copied

    def buffer(self, name: str) -> torch.Tensor | None:
        return None


class HFSource(Source):
    """A transformers model directory, read through a mapping's parts (model/hf_mapping.py)."""

    def __init__(self, directory: Path, parts: dict[str, Part]) -> None:
        self.origin = f"Hugging Face directory '{directory}'"
        self._handles: dict[Path, Any] = {}
        self.files = self._weight_files(directory)
        rows = hf_rows(parts)
        self.parts, self.shapes = {}, {}
        for name, part in parts.items():
            # Hub directories of some models (GPT-2) drop the base model's prefix
            # (`transformer.`), which transformers adds back on load: accept both spellings.
            part = dataclasses.replace(part, hf_name=self._spelling(part))
            if self._first(part) not in self.files:
                continue  # reported by check_covers when this model needs the tensor
            self.parts[name] = part
            self.shapes[name] = self._shape(part, rows[parts[name].hf_name])

    def _weight_files(self, directory: Path) -> dict[str, Path]:
        """Tensor name -> the safetensors file that holds it."""
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ConfigError(
                    f"{self.origin}: '{index.name}' is not a safetensors index (expected JSON "
                    "with a weight_map)"
                ) from None
            return {name: directory / file for name, file in weight_map.items()}
        single = directory / "model.safetensors"
        if not single.is_file():
            raise ConfigError(
                f"{self.origin} has no model.safetensors or model.safetensors.index.json "
                "(bigtrain reads safetensors weights only)"
            )
        return dict.fromkeys(self._open(single).keys(), single)

    def _open(self, file: Path):
        if file not in self._handles:
            try:
                self._handles[file] = safe_open(str(file), "pt")
            except Exception as e:  # a missing or damaged shard: name it, no traceback
                raise ConfigError(f"{self.origin}: cannot read '{file.name}': {e}") from None
        return self._handles[file]

    def _handle(self, hf_name: str):
        return self._open(self.files[hf_name])

    @staticmethod
    def _first(part: Part) -> str:
        """The HF tensor of a part; an expert stack's first expert's."""
        return part.expert_names()[0] if part.experts else part.hf_name

    def _spelling(self, part: Part) -> str:
        name = part.hf_name
        if self._first(part) in self.files or "." not in name:
            return name
        bare = part.hf_name.split(".", 1)[1]
        return bare if self._first(dataclasses.replace(part, hf_name=bare)) in self.files else name

    def _shape(self, part: Part, whole_rows: int) -> tuple[int, ...]:
        """The bigtrain tensor's shape as the file gives it; an HF tensor whose row count is not
        the mapping's (another model config) gives -1 rows, so check_covers names the tensor."""
        if part.experts:  # expert 0's slice; all are alike
            pieces = [self._handle(n).get_slice(n).get_shape() for n in part.expert_parts(0)]
            inner = [sum(p[0] for p in pieces), *pieces[0][1:]] if part.joined else pieces[0][::-1]
            every = all(n in self.files for n in part.expert_names())
            return (part.rows if every else -1, *inner)
        shape = tuple(self._handle(part.hf_name).get_slice(part.hf_name).get_shape())
        shape = shape[::-1] if part.transpose else shape
        if (shape[0] if shape else 1) != whole_rows:
            return (-1, *shape[1:])
        return (part.rows, *shape[1:]) if shape else ()

    def read(self, name: str, key: str, start: int, stop: int) -> torch.Tensor:
        assert key == "param", "a Hugging Face directory holds no optimizer state"
        if start == stop:  # an empty shard (fewer rows than ranks)
            return torch.empty(0)
        shape, part = self.shapes[name], self.parts[name]
        if part.experts:  # the experts the range touches
            row = math.prod(shape[1:])
            first, last = start // row, -(-stop // row)
            rows = torch.stack(
                [
                    part.expert_slice([self._handle(n).get_tensor(n) for n in part.expert_parts(e)])
                    for e in range(first, last)
                ]
            )
            return rows.float().reshape(-1)[start - first * row : stop - first * row]
        if not shape:
            return self._handle(part.hf_name).get_tensor(part.hf_name).float().reshape(-1)
        piece = self._handle(part.hf_name).get_slice(part.hf_name)
        row = math.prod(shape[1:])
        first, last = start // row, -(-stop // row)
        lo, hi = part.offset + first, part.offset + last  # rows of the HF tensor
        rows = piece[:, lo:hi].t() if part.transpose else piece[lo:hi]  # Conv1D: (in, out)
        return rows.float().reshape(-1)[start - first * row : stop - first * row]
