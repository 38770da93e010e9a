"""Checkpoint directories: the manifest that makes them verifiable, and finding them.

A committed checkpoint is a directory `step_XXXXXXXX/` with `manifest.json`: step, backend,
world size, every file's size and sha256, data cursor and skip windows, identity and its hash,
parameter shapes, versions, git commit. `verify` checks every file against it; a directory
without a manifest that verifies is never loaded. Format 2 is the one DCP format
(checkpoint/state.py); format 1, each backend's own layout, is read by `bigtrain ckpt convert`
only (checkpoint/legacy.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import platform
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bigtrain.errors import ConfigError
from bigtrain.utils.files import fsync_dir, fsync_file, sha256_file, usual_permissions

logger = logging.getLogger(__name__)

FORMAT_VERSION = 2
LEGACY_FORMAT_VERSION = 1
"""Each backend's own layout (local safetensors, zero rank files, fsdp DCP by module names)."""
MANIFEST = "manifest.json"
PREFIX = "step_"


class CheckpointError(ConfigError):
    """A checkpoint that does not verify (exit 2 when the user named it)."""


def step_dir_name(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def library_versions() -> dict[str, str]:
    import importlib.metadata as md

    import torch  # here: `bigtrain ckpt verify` and checkpoint_path need no torch

    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("bigtrain", "deepspeed", "transformers"):
        with contextlib.suppress(md.PackageNotFoundError):
            versions[name] = md.version(name)
    return versions


def git_commit() -> str | None:
    """The commit of the bigtrain source tree, when it is a git checkout."""
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def read_manifest(path: Path) -> dict[str, Any]:
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(
            f"checkpoint '{path}' has no {MANIFEST} (never committed, or not a checkpoint)"
        )
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint '{path}': {MANIFEST} is not valid JSON ({e})") from None
    versions = (FORMAT_VERSION, LEGACY_FORMAT_VERSION)
    if not isinstance(manifest, dict) or manifest.get("format_version") not in versions:
        raise CheckpointError(
            f"checkpoint '{path}': unknown manifest format (expected format_version "
            f"{FORMAT_VERSION}, or {LEGACY_FORMAT_VERSION} for `bigtrain ckpt convert`)"
        )
    return manifest


def check_files(path: Path, files: dict[str, dict[str, Any]]) -> None:
    """Size and sha256 of each listed file; raises CheckpointError naming the first that fails."""
    for name, meta in files.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(
                f"checkpoint '{path}': file '{name}' listed in the manifest is missing"
            )
        if f.stat().st_size != meta["size"]:
            raise CheckpointError(
                f"checkpoint '{path}': file '{name}' has {f.stat().st_size} bytes, manifest says {meta['size']}"
            )
        if sha256_file(f) != meta["sha256"]:
            raise CheckpointError(
                f"checkpoint '{path}': file '{name}' fails its sha256 check (corrupted)"
            )


def verify(path: Path) -> dict[str, Any]:
    """The manifest of a committed checkpoint, after checking every file's size and sha256."""
    manifest = read_manifest(path)
    check_files(path, manifest["files"])
    return manifest


def committed_dirs(root: Path) -> list[Path]:
    """Committed checkpoint directories under `root` (a run's checkpoints/), oldest first
    (verification not implied)."""
    if not root.is_dir():
        return []
    dirs = [
        p
        for p in root.iterdir()
        if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX) :].isdigit()
    ]
    return sorted(dirs, key=lambda p: int(p.name[len(PREFIX) :]))


def checkpoint_path(path: Path, verify: Callable[[Path], dict[str, Any]] = verify) -> Path:
    """The checkpoint a user's path names, wherever a command takes one: a checkpoint directory
    (it has manifest.json) as it is (its caller verifies it); a run directory: its newest
    committed checkpoint that verifies (`verify`, sha256 of every file; a newer one that fails
    is logged and passed over). CheckpointError (exit 2) for anything else."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path
    committed = committed_dirs(path / "checkpoints")
    failures = []
    for candidate in reversed(committed):
        try:
            verify(candidate)
            return candidate
        except CheckpointError as e:
            logger.warning("bigtrain: passed over %s: %s", candidate, e)
            failures.append(str(e))
    if committed:
        raise CheckpointError(
            f"run directory '{path}': none of its {len(committed)} committed checkpoints "
            f"verifies (the newest: {failures[0]})"
        )
    raise CheckpointError(
        f"'{path}' is neither a checkpoint (no {MANIFEST}) nor a run directory with committed "
        f"checkpoints (no {path}/checkpoints/{PREFIX}*)"
    )


def list_files(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())


def hash_files(
    directory: Path, names: list[str], hashed: dict[str, str] | None = None
) -> dict[str, dict[str, Any]]:
    """Permissions, fsync and sha256 of files this rank wrote, `names` and those `hashed` as they
    were written (their sha256 by name): {name: {size, sha256}}."""
    hashed = hashed or {}
    out = {}
    for name in [*names, *hashed]:
        path = directory / name
        usual_permissions(path)
        fsync_file(path)
        sha256 = hashed[name] if name in hashed else sha256_file(path)
        out[name] = {"size": path.stat().st_size, "sha256": sha256}
    return out


def copy_into(paths: list[Path], directory: Path) -> list[str]:
    """Copy files, and the files of directories, into `directory` under their own names; the
    relative names written (what does not exist is skipped)."""
    names = []
    for path in paths:
        if path.is_file():
            shutil.copyfile(path, directory / path.name)
            names.append(path.name)
        elif path.is_dir():
            (directory / path.name).mkdir(exist_ok=True)
            for file in sorted(f for f in path.iterdir() if f.is_file()):
                shutil.copyfile(file, directory / path.name / file.name)
                names.append(f"{path.name}/{file.name}")
    return names


def write_manifest(
    directory: Path, manifest: dict[str, Any], files: dict[str, dict[str, Any]]
) -> None:
    """manifest.json of a checkpoint whose files are written and hashed (`files`), fsynced:
    `manifest` gives step, backend, world_size, data, identity, shapes; versions are added."""
    full = {
        "format_version": FORMAT_VERSION,
        **manifest,
        "files": dict(sorted(files.items())),
        "config_hash": identity_hash(manifest["identity"]),
        "versions": library_versions(),
        "git_commit": git_commit(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    (directory / MANIFEST).write_text(json.dumps(full, indent=1))
    fsync_file(directory / MANIFEST)
    fsync_dir(directory)


def identity_hash(identity: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def identity_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Keys whose value differs between a checkpoint's identity and this run's."""
    return sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k))


def shape_changes(saved: dict[str, list[int]] | None, current: dict[str, list[int]]) -> list[str]:
    """'name [saved shape] -> [this model's shape]' for each parameter whose shape differs or
    that one side lacks; [] for a checkpoint that predates recorded shapes."""
    if saved is None:
        return []
    return [
        f"{name} {saved.get(name, 'missing')} -> {current.get(name, 'missing')}"
        for name in sorted(set(saved) | set(current))
        if saved.get(name) != current.get(name)
    ]
