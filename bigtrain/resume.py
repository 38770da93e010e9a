"""Where a run starts: a resumed checkpoint (`checkpoint.resume`), existing weights
(`model.init_from`: a bigtrain checkpoint or a Hugging Face directory), or the fresh
initialisation.

A resume continues a run: weights, optimizer state, counters, data cursor and RNG. Its checkpoint
may come from any backend at any world size and mesh (one DCP format, DCP reshards), for a
model of the same shapes; the run's identity (model, corpus and tokenizer, global batch) may
change only with `checkpoint.allow_config_change`. Every config key that changed since the
checkpoint is reported, allowed or not.

`init_from` starts a new run (step 0, fresh optimizer state, the data order from the start) from
existing weights, for example a finished pretraining run or a released model; it applies only
when there is nothing to resume, so a restarted job resumes its own checkpoints instead.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn

from bigtrain.checkpoint.manager import CheckpointManager, refuse_legacy
from bigtrain.checkpoint.manifest import (
    MANIFEST,
    PREFIX,
    checkpoint_path,
    committed_dirs,
    identity_changes,
    shape_changes,
)
from bigtrain.checkpoint.sources import HFSource, InitialValues
from bigtrain.checkpoint.state_io import persistent_buffers
from bigtrain.config import Config, ModelConfig, TrainConfig, config_changes
from bigtrain.data.read.stream import SampleStream
from bigtrain.errors import ConfigError, SharedConfigError
from bigtrain.model.hf_check import check_hf_config
from bigtrain.model.hf_mapping import mapping_for, mapping_for_hf
from bigtrain.parallel.backends.base import Backend
from bigtrain.parallel.layout import Layout
from bigtrain.state.run import RunState
from bigtrain.train.setup import RunSetup, StartPoint
from bigtrain.utils.names import canonical_name
from bigtrain.utils.tensors import full_shape


def run_identity(model_cfg: ModelConfig, corpus_key: str, global_batch_size: int) -> dict[str, Any]:
    """What may not change on resume without checkpoint.allow_config_change=true."""
    # model.init_from only says where a new run's weights come from: a resume ignores it.
    fields = dataclasses.asdict(model_cfg).items()
    model = {f"model.{k}": v for k, v in fields if k != "init_from"}
    return {
        **model,
        "data.corpus_and_tokenizer": corpus_key,
        "global_batch_size": global_batch_size,
    }


@dataclass(frozen=True)
class ResumeTarget:
    """The checkpoint a run resumes (found before anything is built: its global batch decides
    the batch split), and the committed ones passed over on the way."""

    path: Path | None  # None: nothing to resume
    manifest: dict[str, Any]
    invalid: tuple[dict[str, str], ...] = ()

    def global_batch(self) -> int | None:
        return self.manifest.get("identity", {}).get("global_batch_size") if self.path else None


def find_resume(choice: str, manager: CheckpointManager) -> ResumeTarget:
    """What checkpoint.resume=`choice` resumes, verified (a collective: every rank calls it)."""
    invalid: list[dict[str, str]] = []
    found = _resume_target(choice, manager, invalid)
    if found is None:
        return ResumeTarget(None, {}, tuple(invalid))
    refuse_legacy(*found)
    return ResumeTarget(*found, tuple(invalid))


def keep_global_batch(
    train: TrainConfig, layout: Layout, target: ResumeTarget, manager: CheckpointManager
) -> tuple[TrainConfig, str | None]:
    """`train` split to keep the resumed checkpoint's global batch at this layout (Layout
    .keep_global_batch), and the line saying so; unchanged for a fresh run."""
    saved = target.global_batch()
    if target.path is None or saved is None:
        return train, None
    saved_train = (yaml.safe_load(manager.saved_config(target.path)) or {}).get("train", {})
    try:
        return layout.keep_global_batch(train, saved, saved_train.get("micro_batch_size"))
    except ConfigError as e:
        raise SharedConfigError(f"checkpoint '{target.path}': {e}") from None


def start_state(
    cfg: Config,
    run: RunState,
    setup: RunSetup,
    manager: CheckpointManager,
    target: ResumeTarget,
    fault_corrupted: str | None = None,
    batch_note: str | None = None,
) -> StartPoint:
    """Resume the run's state from `target`, or initialise it: where the run starts. `batch_note`:
    how the batch was split anew to keep the checkpoint's global batch (keep_global_batch)."""
    invalid = target.invalid
    if target.path is None:
        details = (
            init_from(cfg.model, run.backend, setup.shapes, manager)
            if cfg.model.init_from
            else None
        )
        return StartPoint(None, details, invalid, fault_corrupted)
    path, manifest = target.path, target.manifest
    _check_data_order(path, manifest, run.stream)
    changes = identity_changes(manifest["identity"], setup.identity)
    if changes and not cfg.checkpoint.allow_config_change:
        shown = ", ".join(
            f"{k} ({manifest['identity'].get(k)!r} -> {setup.identity.get(k)!r})" for k in changes
        )
        hint = ""
        if "global_batch_size" in changes and cfg.train.global_batch_size is not None:
            hint = (
                f" (train.global_batch_size={cfg.train.global_batch_size} is set; leave it unset "
                "and bigtrain keeps the checkpoint's global batch at any world size)"
            )
        raise SharedConfigError(
            f"checkpoint '{path}' was written with different {shown}{hint}; "
            "set checkpoint.allow_config_change=true to resume anyway"
        )
    _check_shapes(path, manifest, setup.shapes)
    run.load_state_dict(manager.load(path, run.backend))
    restarts = {
        k.lower(): int(os.environ[k])
        for k in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")
        if k in os.environ
    }
    changed = config_changes(manager.saved_config(path), cfg)
    if cfg.train.global_batch_size is not None:  # derived for the world size, not a setting
        changed.pop("train.grad_accum_steps", None)
    resume = {
        "path": str(path),
        "changed": sorted(changed),
        "changes": changed,
        "identity_changed": changes,
        **restarts,
    }
    if batch_note is not None:
        resume["batch"] = batch_note
    return StartPoint(resume, None, invalid, fault_corrupted)


def _check_data_order(path: Path, manifest: dict[str, Any], stream: SampleStream) -> None:
    """Before the identity: a data order that cannot continue is one message, not a suggestion of
    checkpoint.allow_config_change (which cannot help there) followed by another error."""
    if "data" not in manifest:
        return
    try:
        stream.check_state(manifest["data"])
    except ConfigError as e:
        raise ConfigError(f"checkpoint '{path}': {e}") from None


def _resume_target(
    choice: str, manager: CheckpointManager, invalid: list[dict[str, str]]
) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint checkpoint.resume=`choice` names and its manifest, or None; `invalid` gets
    the committed ones passed over."""
    if choice == "never":
        return None
    if choice == "auto":
        return manager.newest_valid(
            on_invalid=lambda p, why: invalid.append({"path": str(p), "reason": why})
        )
    path = checkpoint_path(Path(choice), verify=manager.verify)  # a run directory: its newest
    return path, manager.verify(path)  # CheckpointError (exit 2) names the file that fails


def _check_shapes(path: Path, manifest: dict[str, Any], shapes: dict[str, list[int]]) -> None:
    """The same parameter shapes: nothing else can be loaded."""
    reshaped = shape_changes(manifest.get("shapes"), shapes)
    if reshaped:
        shown = "; ".join(reshaped[:6])
        if len(reshaped) > 6:
            shown += f"; ... ({len(reshaped)} in all)"
        raise ConfigError(
            f"checkpoint '{path}' holds parameters of other shapes than this model ({shown}): a "
            "changed model shape cannot be loaded, not even with "
            "checkpoint.allow_config_change=true; start another train.out_dir (with "
            "model.init_from for weights of the same shapes)"
        )


def init_from(
    model_cfg: ModelConfig,
    backend: Backend,
    shapes: dict[str, list[int]],
    manager: CheckpointManager,
) -> dict[str, Any]:
    """Load the weights of `model.init_from` (a bigtrain checkpoint of any backend, or a Hugging
    Face directory), each rank reading only its slices; the optimizer state stays fresh, and the
    step, data cursor and RNG stay those of a new run. The event gets the weights' fingerprint."""
    load, details = init_loader(model_cfg, backend, shapes, manager)
    load()
    details["fingerprint"] = backend.fingerprint()  # a collective: every rank
    return details


def init_loader(
    model_cfg: ModelConfig,
    backend: Backend,
    shapes: dict[str, list[int]],
    manager: CheckpointManager,
) -> tuple[Callable[[], None], dict[str, Any]]:
    """What loads `model.init_from`'s weights into `backend` (a model of `shapes`) with a fresh
    optimizer, and the event's details."""
    path = Path(model_cfg.init_from)
    details: dict[str, Any] = {"path": str(path)}
    if (path / MANIFEST).is_file() or committed_dirs(path / "checkpoints"):
        path = checkpoint_path(path, verify=manager.verify)  # a run directory: its newest
        if str(path) != details["path"]:
            details["checkpoint"] = str(path)
        manifest = manager.verify(path)
        refuse_legacy(path, manifest)
        _check_shapes(path, manifest, shapes)
        details.update(
            source="checkpoint", backend=manifest["backend"], source_step=manifest["step"]
        )
        return lambda: manager.load_weights(path, backend), details
    if model_cfg.kind == "hf":  # its persistent buffers too (DeepSeek-V3's score correction)
        buffers = persistent_buffers(backend.model) if isinstance(backend.model, nn.Module) else {}
        shapes = {**shapes, **{n: list(b.shape) for n, b in buffers.items()}}
    source = hf_source(path, model_cfg, shapes)
    return lambda: backend.load_from(source, optimizer=False), {**details, "source": "huggingface"}


def start_weights(
    model_cfg: ModelConfig,
    seed: int,
    backend: Backend,
    manager: CheckpointManager,
    device: torch.device,
) -> Callable[[], None] | None:
    """What loads the run's initial weights again, with a fresh optimizer: a rollback to the
    start in a process that does not hold it (resumed, or snapshots off) rebuilds it so.
    model.init_from's source, or bigtrain's GPT's seeded initial values; None for a
    transformers model's own init, which is not kept."""
    model = backend.model
    if model_cfg.init_from:
        shapes = {canonical_name(n): list(full_shape(p)) for n, p in model.named_parameters()}
        return lambda: init_loader(model_cfg, backend, shapes, manager)[0]()
    if hasattr(model, "init_value"):
        return lambda: backend.load_from(InitialValues(model, seed, device), optimizer=False)
    return None


def hf_source(path: Path, model_cfg: ModelConfig, shapes: dict[str, list[int]]) -> HFSource:
    """A Hugging Face directory as a source for this model: the GPT-2 or Llama mapping for the
    built-in GPT, transformers' own names (under `hf.`) for model.kind=hf."""
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"key 'model.init_from': '{path}' is neither a bigtrain checkpoint (no {MANIFEST}), "
            f"a run directory with committed checkpoints (no {path}/checkpoints/{PREFIX}*) nor a "
            "Hugging Face model directory (no config.json)"
        )
    if model_cfg.kind == "hf":  # HFCausalLM keeps the transformers model as `hf`: its layout
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(path))
        parts = mapping_for_hf(config, {n: tuple(s) for n, s in shapes.items()}).parts
    else:
        from transformers import AutoConfig

        mapping = mapping_for(model_cfg, {k: tuple(v) for k, v in shapes.items()})
        found = AutoConfig.from_pretrained(str(path)).to_dict()
        check_hf_config(mapping, found, f"key 'model.init_from': Hugging Face directory '{path}'")
        parts = mapping.parts
    return HFSource(path, parts)
