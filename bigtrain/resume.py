"""Where a run starts: a resumed checkpoint (`checkpoint.resume`), the weights of another run's
checkpoint (`checkpoint.init_from`), or the fresh initialisation.

A resume continues a run: weights, optimizer state, counters, data cursor and RNG. Its checkpoint
must have been written by the same backend for a model of the same shapes; the run's identity
(model, corpus and tokenizer, global batch) may change only with `checkpoint.allow_config_change`.
Every config key that changed since the checkpoint is reported, allowed or not.

`init_from` starts a new run (step 0, fresh optimizer state, the data order from the start) from
another run's weights, for example a finished pretraining run; it applies only when there is
nothing to resume, so a restarted job resumes its own checkpoints instead.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from bigtrain.config import Config, config_changes
from bigtrain.errors import ConfigError
from bigtrain.store.checkpoint import CheckpointManager, identity_changes, shape_changes
from bigtrain.train import Trainer


def start_state(cfg: Config, trainer: Trainer, manager: CheckpointManager) -> dict[str, Any] | None:
    """Resume or initialise `trainer`; the `resume` event's details, or None."""
    found = _resume_target(cfg, trainer, manager)
    if found is None:
        if cfg.checkpoint.init_from:
            trainer.context["init_from"] = init_from(cfg, trainer, manager)
        return None
    path, manifest = found
    _check_backend(path, manifest, trainer)
    changes = identity_changes(manifest["identity"], trainer.context["identity"])
    if changes and not cfg.checkpoint.allow_config_change:
        raise ConfigError(
            f"checkpoint '{path}' was written with different {', '.join(changes)}; "
            "set checkpoint.allow_config_change=true to resume anyway"
        )
    _check_shapes(path, manifest, trainer)
    trainer.load_trainer_state(manager.load(path, trainer.backend))
    restarts = {
        k.lower(): int(os.environ[k])
        for k in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")
        if k in os.environ
    }
    changed = config_changes((path / "config.yaml").read_text(), cfg)
    return {
        "path": str(path),
        "changed": sorted(changed),
        "changes": changed,
        "identity_changed": changes,
        **restarts,
    }


def _resume_target(
    cfg: Config, trainer: Trainer, manager: CheckpointManager
) -> tuple[Path, dict[str, Any]] | None:
    choice = cfg.checkpoint.resume
    if choice == "never":
        return None
    if choice == "auto":
        invalid: list[dict[str, str]] = []
        found = manager.newest_valid(
            on_invalid=lambda p, why: invalid.append({"path": str(p), "reason": why})
        )
        trainer.context["invalid_checkpoints"] = invalid
        return found
    path = Path(choice)
    return path, manager.verify(path)  # CheckpointError (exit 2) names the file that fails


def _check_backend(path: Path, manifest: dict[str, Any], trainer: Trainer) -> None:
    if manifest["backend"] != trainer.backend.name:
        raise ConfigError(
            f"checkpoint '{path}' was written by parallel.backend={manifest['backend']}, "
            f"this run uses {trainer.backend.name}: checkpoints load on the backend that wrote them"
        )


def _check_shapes(path: Path, manifest: dict[str, Any], trainer: Trainer) -> None:
    """The same parameter shapes: nothing else can be loaded."""
    reshaped = shape_changes(manifest.get("shapes"), trainer.context["shapes"])
    if reshaped:
        shown = "; ".join(reshaped[:6])
        if len(reshaped) > 6:
            shown += f"; ... ({len(reshaped)} in all)"
        raise ConfigError(
            f"checkpoint '{path}' holds parameters of other shapes than this model ({shown}): a "
            "changed model shape cannot be loaded, not even with "
            "checkpoint.allow_config_change=true; start another train.out_dir (with "
            "checkpoint.init_from for weights of the same shapes)"
        )


def init_from(cfg: Config, trainer: Trainer, manager: CheckpointManager) -> dict[str, Any]:
    """Load the model weights of checkpoint `checkpoint.init_from`; the optimizer state stays
    fresh, and the step, data cursor and RNG stay those of a new run."""
    path = Path(cfg.checkpoint.init_from)
    manifest = manager.verify(path)
    _check_backend(path, manifest, trainer)
    _check_shapes(path, manifest, trainer)
    backend = trainer.backend
    fresh = backend.local_state()  # before the first step: empty optimizer state on every rank
    backend.load(path)
    loaded = backend.local_state()
    backend.load_local_state({**loaded, "optim": fresh["optim"]})
    return {"path": str(path), "source_step": manifest["step"]}
