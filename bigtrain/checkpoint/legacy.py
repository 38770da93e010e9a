"""Checkpoints of earlier bigtrain versions, read for `bigtrain ckpt convert` only.

Before the one DCP format (checkpoint/state.py, manifest format_version 2) each backend wrote its
own layout (manifest format_version 1):

- `local`: `model.safetensors` (weights and buffers by canonical name) and
  `optimizer.safetensors` (`<name>.exp_avg`, `<name>.exp_avg_sq`; step counts in its metadata);
- `zero`: `zero/rank_<r>.safetensors`, each rank's FP32 flat partitions and moments with a table
  of fragments (which range of which flattened parameter lies where), `zero/buffers.safetensors`,
  and in rank 0's header the step counts, DeepSpeed's loss scaler and engine counters;
- `fsdp`: DCP under module FQNs (`model.<fqn>`, `optim.state.<fqn>.<key>`).

Earlier still, the GPT had fused qkv and SwiGLU layers (model/fused.py): `UnfusedSource` reads
those under today's names. `legacy_source` picks the reader; convert writes the current format.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from bigtrain.checkpoint.sources import Source
from bigtrain.checkpoint.state import NO_DIST_WARNING
from bigtrain.errors import ConfigError
from bigtrain.model.fused import fused_rows, is_fused, unfused_shapes
from bigtrain.optim.optimizer import MOMENTS
from bigtrain.utils.names import canonical_name

ZERO_FORMAT = "bigtrain-zero-1"


def _slice_rows(handle, key: str, shape, start: int, stop: int) -> torch.Tensor:
    """Elements [start, stop) of a safetensors tensor, reading only the rows that hold them."""
    if not shape:
        return handle.get_tensor(key).float().reshape(-1)
    if len(shape) == 1:
        return handle.get_slice(key)[start:stop].float().reshape(-1)
    row = math.prod(shape[1:])
    first, last = start // row, -(-stop // row)
    rows = handle.get_slice(key)[first:last].float().reshape(-1)
    return rows[start - first * row : stop - first * row]


class LocalSource(Source):
    """`model.safetensors` (canonical names, tied weights once) and `optimizer.safetensors`
    (`<name>.exp_avg`, `<name>.exp_avg_sq`; steps in its metadata)."""

    has_optimizer = True

    def __init__(self, directory: Path) -> None:
        self.origin = f"checkpoint '{directory}'"
        if (directory / "optimizer.pt").is_file():
            raise ConfigError(
                f"{self.origin} holds optimizer.pt, the local layout of bigtrain before universal "
                "checkpoints; its optimizer state would be lost: resume it with that bigtrain "
                "version, or start from its weights with model.init_from"
            )
        self.model = safe_open(str(directory / "model.safetensors"), "pt")
        optim = directory / "optimizer.safetensors"
        self.optim = safe_open(str(optim), "pt") if optim.is_file() else None
        meta = (self.optim.metadata() or {}) if self.optim else {}
        self.steps: dict[str, float] = json.loads(meta.get("steps", "{}"))
        self.shapes = {}
        for key in self.model.keys():  # noqa: SIM118 (safe_open is not iterable)
            self.shapes[key] = tuple(self.model.get_slice(key).get_shape())

    def read(self, name: str, key: str, start: int, stop: int) -> torch.Tensor:
        if key == "param":
            return _slice_rows(self.model, name, self.shapes[name], start, stop)
        if self.optim is None or not self.steps.get(name):
            return torch.zeros(stop - start)
        return _slice_rows(self.optim, f"{name}.{key}", self.shapes[name], start, stop)

    def step(self, name: str) -> float:
        return float(self.steps.get(name, 0.0))


@dataclass
class SavedFragment:
    file: Path
    group: int
    flat_start: int
    start: int
    numel: int
    shape: tuple[int, ...]


def read_zero_index(directory: Path) -> tuple[dict[str, list[SavedFragment]], dict[str, Any]]:
    """Every saved fragment by parameter name, and rank 0's header."""
    files = sorted((directory / "zero").glob("rank_*.safetensors"))
    if not files:
        raise ConfigError(f"checkpoint '{directory}' has no zero/rank_*.safetensors files")
    index: dict[str, list[SavedFragment]] = {}
    header: dict[str, Any] = {}
    for file in files:
        with safe_open(str(file), "pt") as f:
            meta = f.metadata() or {}
        if meta.get("format") != ZERO_FORMAT:
            raise ConfigError(f"checkpoint file '{file}': not a {ZERO_FORMAT} file")
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


class ZeroSource(Source):
    """A `zero` checkpoint: each parameter's fragments in the rank files (see the module's doc)."""

    has_optimizer = True

    def __init__(self, directory: Path) -> None:
        self.origin = f"checkpoint '{directory}'"
        self.directory = directory
        self.index, self.header = read_zero_index(directory)
        self.shapes = {name: frags[0].shape for name, frags in self.index.items()}
        self._handles: dict[Path, Any] = {}

    def _handle(self, file: Path):
        if file not in self._handles:
            self._handles[file] = safe_open(str(file), "pt")
        return self._handles[file]

    def read(self, name: str, key: str, start: int, stop: int) -> torch.Tensor:
        out = torch.empty(stop - start)
        if key != "param" and not self.step(name):
            return out.zero_()
        tensor = "fp32" if key == "param" else key
        covered = 0
        for saved in self.index[name]:
            lo, hi = max(start, saved.start), min(stop, saved.start + saved.numel)
            if lo >= hi:
                continue
            src = saved.flat_start + lo - saved.start
            piece = self._handle(saved.file).get_slice(f"group{saved.group}.{tensor}")
            out[lo - start : hi - start].copy_(piece[src : src + hi - lo])
            covered += hi - lo
        if covered != stop - start:
            raise ConfigError(
                f"{self.origin}: parameter '{name}' values {start}..{stop} are not all in it"
            )
        return out

    def step(self, name: str) -> float:
        return float(self.header["steps"][self.index[name][0].group])

    def buffer(self, name: str) -> torch.Tensor | None:
        return self.extra_buffers().get(name)

    def extra_buffers(self) -> dict[str, torch.Tensor]:
        file = self.directory / "zero/buffers.safetensors"
        if not file.is_file():
            return {}
        with safe_open(str(file), "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)

    def loss_scale(self) -> float | None:
        scale = (self.header.get("loss_scaler") or {}).get("cur_scale")
        return float(scale) if scale is not None else None


class DCPSource(Source):
    """An `fsdp` checkpoint: DCP's `model.<fqn>` and `optim.state.<fqn>.<key>` entries."""

    has_optimizer = True

    def __init__(self, directory: Path) -> None:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.origin = f"checkpoint '{directory}'"
        self.path = directory / "dcp"
        meta = FileSystemReader(str(self.path)).read_metadata().state_dict_metadata
        self.keys: dict[tuple[str, str], str] = {}  # (canonical name, key) -> DCP key
        self.shapes, self._buffers = {}, []
        params = {k[len("model.") :] for k in meta if k.startswith("model.")}
        for fqn in params:
            entry = meta[f"model.{fqn}"]
            if not isinstance(entry, TensorStorageMetadata):
                continue
            name = canonical_name(fqn)
            self.keys[(name, "param")] = f"model.{fqn}"
            self.shapes[name] = tuple(entry.size)
            for key in (*MOMENTS, "step"):
                if f"optim.state.{fqn}.{key}" in meta:
                    self.keys[(name, key)] = f"optim.state.{fqn}.{key}"
        self._cached: tuple[str, str, torch.Tensor] | None = None

    def _load(self, name: str, key: str) -> torch.Tensor:
        if self._cached is not None and self._cached[:2] == (name, key):
            return self._cached[2]
        import torch.distributed.checkpoint as dcp

        full = torch.empty(self.shapes[name] if key != "step" else ())
        with warnings.catch_warnings():
            # DCP warns on every load without a process group, even one asked for with no_dist:
            # here each rank reads whole tensors on its own by design.
            warnings.filterwarnings("ignore", NO_DIST_WARNING, UserWarning)
            dcp.load({self.keys[(name, key)]: full}, checkpoint_id=str(self.path), no_dist=True)
        self._cached = (name, key, full)
        return full

    def read(self, name: str, key: str, start: int, stop: int) -> torch.Tensor:
        if key != "param" and (name, key) not in self.keys:
            return torch.zeros(stop - start)
        return self._load(name, key).reshape(-1)[start:stop].float()

    def step(self, name: str) -> float:
        return float(self._load(name, "step")) if (name, "step") in self.keys else 0.0


class UnfusedSource(Source):
    """A checkpoint from before the GPT split its fused layers, under today's names: each read of
    `attn.q`, `attn.k`, `attn.v` (or SwiGLU's `mlp.gate`, `mlp.up`) is a read of its rows of the
    fused `attn.qkv` (`mlp.up`), weights and moments alike (model/fused.py)."""

    def __init__(self, fused: Source) -> None:
        self.fused, self.origin, self.has_optimizer = fused, fused.origin, fused.has_optimizer
        self.rows = fused_rows(fused.shapes)
        self.shapes = unfused_shapes(fused.shapes)

    def _fused(self, name: str, start: int) -> tuple[str, int]:
        """The fused tensor holding `name`, and the element offset of `name`'s first row."""
        if name not in self.rows:
            return name, start
        old, first_row, _ = self.rows[name]
        return old, start + first_row * math.prod(self.shapes[name][1:])

    def read(self, name: str, key: str, start: int, stop: int) -> torch.Tensor:
        old, at = self._fused(name, start)
        return self.fused.read(old, key, at, at + stop - start)

    def step(self, name: str) -> float:
        return self.fused.step(self._fused(name, 0)[0])

    def buffer(self, name: str) -> torch.Tensor | None:
        return self.fused.buffer(name)

    def extra_buffers(self) -> dict[str, torch.Tensor]:
        return self.fused.extra_buffers()

    def loss_scale(self) -> float | None:
        return self.fused.loss_scale()


def legacy_source(directory: Path, backend: str) -> Source:
    """The reader of a format-1 checkpoint written by `backend` (its manifest's), under today's
    names also when it was written before the GPT's fused layers were split."""
    source = {"local": LocalSource, "zero": ZeroSource, "fsdp": DCPSource}[backend](directory)
    return UnfusedSource(source) if is_fused(source.shapes) else source
