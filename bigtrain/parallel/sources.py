"""Read model and optimizer tensors by canonical parameter name, from any format bigtrain reads.

A source answers `read(name, key, start, stop)`: elements [start, stop) of the flattened FP32
tensor `key` ("param", "exp_avg", "exp_avg_sq") of parameter `name`. Every backend loads from a
source by asking for exactly the slices it keeps (an FSDP2 shard's rows, a ZeRO fragment), so a
checkpoint of any backend at any world size, or a Hugging Face directory, loads into any backend
at any world size without a process ever holding the whole model:

- `LocalSource`: a `local` checkpoint (`model.safetensors`, `optimizer.safetensors`), sliced.
- `ZeroSource`: a `zero` checkpoint (fragments by name, zero_ckpt.py), sliced.
- `DCPSource`: an `fsdp` checkpoint (torch.distributed.checkpoint); DCP reads whole tensors
  without a process group, so this holds one parameter at a time.
- `HFSource`: a transformers directory (safetensors, sharded or not) through the name and layout
  mapping of model/hf_layout.py (GPT-2's q/k/v in one c_attn, transposed Conv1D weights), sliced.
- `UnfusedSource`: a checkpoint from before the GPT split its fused qkv and SwiGLU layers
  (model/fused.py), read under today's names.
- `InitialValues`: a model's exact FP32 initial values, made one parameter at a time.
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from bigtrain.errors import ConfigError
from bigtrain.model.fused import fused_rows, is_fused, unfused_shapes
from bigtrain.model.hf_layout import Part, hf_rows
from bigtrain.model.init import initial_value
from bigtrain.optim.optimizer import MOMENTS
from bigtrain.parallel import zero_ckpt
from bigtrain.utils.names import canonical_name
from bigtrain.utils.tensors import full_shape


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
        missing = sorted(set(shapes) - set(self.shapes))
        wrong = [
            f"{n} {list(self.shapes[n])} there, {list(s)} in this model"
            for n, s in sorted(shapes.items())
            if n in self.shapes and tuple(self.shapes[n]) != tuple(s)
        ]
        if missing or wrong:
            raise ConfigError(
                f"{self.origin}: does not fit this model (missing {missing[:5]}"
                + (f"; other shapes: {'; '.join(wrong[:4])}" if wrong else "")
                + ")"
            )


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


def write_local_layout(
    directory: Path,
    weights: dict[str, torch.Tensor],
    states: dict[str, tuple[float, dict[str, torch.Tensor]]],
) -> list[str]:
    """The `local` checkpoint layout that LocalSource reads: `model.safetensors` (weights and
    buffers by canonical name) and `optimizer.safetensors` (FP32 moments `<name>.<moment>`, each
    parameter's step count in its metadata); `states`: name -> (step, moments)."""
    save_file(weights, str(directory / "model.safetensors"))
    moments = {f"{name}.{k}": v for name, (_, m) in states.items() for k, v in m.items()}
    steps = {name: float(step) for name, (step, _) in states.items()}
    meta = {"steps": json.dumps(steps)}
    save_file(moments, str(directory / "optimizer.safetensors"), metadata=meta)
    return ["model.safetensors", "optimizer.safetensors"]


class ZeroSource(Source):
    """A `zero` checkpoint: each parameter's fragments in the rank files (zero_ckpt.py)."""

    has_optimizer = True

    def __init__(self, directory: Path) -> None:
        self.origin = f"checkpoint '{directory}'"
        self.directory = directory
        self.index, self.header = zero_ckpt.read_index(directory)
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


NO_DIST_WARNING = "torch.distributed is disabled, unavailable or uninitialized"
"""The start of the UserWarning torch.distributed.checkpoint.load gives without a process group."""


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


class HFSource(Source):
    """A transformers model directory, read through a layout's parts (model/hf_layout.py)."""

    def __init__(self, directory: Path, parts: dict[str, Part]) -> None:
        self.origin = f"Hugging Face directory '{directory}'"
        self._handles: dict[Path, Any] = {}
        self.files = self._weight_files(directory)
        rows = hf_rows(parts)
        self.parts, self.shapes = {}, {}
        for name, part in parts.items():
            # Hub directories of some models (GPT-2) drop the base model's prefix
            # (`transformer.`), which transformers adds back on load: accept both spellings.
            part = dataclasses.replace(part, hf_name=self._spelling(part.hf_name))
            if part.hf_name not in self.files:
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

    def _spelling(self, hf_name: str) -> str:
        if hf_name in self.files or "." not in hf_name:
            return hf_name
        bare = hf_name.split(".", 1)[1]
        return bare if bare in self.files else hf_name

    def _shape(self, part: Part, whole_rows: int) -> tuple[int, ...]:
        """The bigtrain tensor's shape as the file gives it; an HF tensor whose row count is not
        the layout's (another model config) gives -1 rows, so check_covers names the tensor."""
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
        if not shape:
            return self._handle(part.hf_name).get_tensor(part.hf_name).float().reshape(-1)
        piece = self._handle(part.hf_name).get_slice(part.hf_name)
        row = math.prod(shape[1:])
        first, last = start // row, -(-stop // row)
        lo, hi = part.offset + first, part.offset + last  # rows of the HF tensor
        rows = piece[:, lo:hi].t() if part.transpose else piece[lo:hi]  # Conv1D: (in, out)
        return rows.float().reshape(-1)[start - first * row : stop - first * row]


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


def checkpoint_source(directory: Path, backend: str) -> Source:
    """The source of a bigtrain checkpoint written by `backend` (its manifest's), under today's
    names also when it was written before the GPT's fused layers were split."""
    source = {"local": LocalSource, "zero": ZeroSource, "fsdp": DCPSource}[backend](directory)
    return UnfusedSource(source) if is_fused(source.shapes) else source
