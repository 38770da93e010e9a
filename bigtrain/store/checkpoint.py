"""Checkpoints committed atomically, with a manifest that makes them verifiable.

A checkpoint is written into `checkpoints/.tmp-step_XXXXXXXX/`, every file fsynced, then
`manifest.json` (step, backend, world size, every file's size and sha256, data cursor and skip
windows, versions, git commit, config hash) is written last, and the directory is renamed to
`step_XXXXXXXX`. A directory without a manifest that verifies is never loaded, so a crash during
a write leaves at most a stale `.tmp-*` directory, which the next save removes.

Each rank fsyncs and hashes the files it wrote itself. Asynchronously (`save(..., async_ok=True)`)
the backend copies its state to host memory and writes it in the background; this rank's hashing
follows there too, and the commit (gather the hashes, manifest, rename) happens at a later step
boundary once every rank's background work is done (`poll_pending`).
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
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from bigtrain.errors import ConfigError
from bigtrain.model.fused import is_fused
from bigtrain.parallel.sources import checkpoint_source
from bigtrain.store.rng import rng_state, set_rng_state
from bigtrain.utils.dist import all_gather_objects, all_true, barrier
from bigtrain.utils.files import fsync_dir, fsync_file, sha256_file, usual_permissions

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
PREFIX = "step_"


class CheckpointError(ConfigError):
    """A checkpoint that does not verify (exit 2 when the user named it)."""


def step_dir_name(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def library_versions() -> dict[str, str]:
    import importlib.metadata as md

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
    if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint '{path}': unknown manifest format (expected format_version {FORMAT_VERSION})"
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


def _list_files(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())


def hash_files(directory: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """Permissions, fsync and sha256 of files this rank wrote: {name: {size, sha256}}."""
    out = {}
    for name in names:
        path = directory / name
        usual_permissions(path)  # safetensors writes 0600
        fsync_file(path)
        out[name] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
    return out


class CheckpointManager:
    """Saves, lists, verifies and loads the checkpoints under `root` (out_dir/checkpoints).

    Every rank calls save/verify/load together. The directory must be shared by all ranks (as it
    is for DCP and DeepSpeed): each rank writes and hashes its part, rank 0 writes the manifest and
    commits by rename once every rank is done."""

    def __init__(self, root: Path, keep: int, rank: int = 0, world_size: int = 1) -> None:
        self.root, self.keep, self.rank, self.world_size = root, keep, rank, world_size
        self.pending: tuple[Future, tuple] | None = None  # (hashes of an async save, commit args)
        self.carry: list[Path] = []
        """Files and directories of the run that each checkpoint carries a copy of (the
        tokenizer, a transformers model's config), so that an export or a conversion needs
        nothing but the checkpoint."""
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="bigtrain-ckpt-hash")
        self.write_s = 0.0  # this rank's last save: its start to its files written and hashed
        self.last_save: dict[str, Any] = {}  # what the last commit cost (_commit)
        self.last_save: dict[str, Any] = {}  # the last commit's bytes_per_rank and write_s

    def committed(self) -> list[Path]:
        """Committed checkpoint directories, oldest first (verification not implied)."""
        return committed_dirs(self.root)

    def save(
        self,
        step: int,
        backend,
        trainer_state: dict[str, Any],
        identity: dict[str, Any],
        config_yaml: str,
        async_ok: bool = False,
        host_state: dict[str, Any] | None = None,
        shapes: dict[str, list[int]] | None = None,
    ) -> Path | None:
        """Write and commit a checkpoint of `step` (`shapes`: the model's parameter shapes by
        canonical name, recorded in the manifest so that a resume can refuse another shape), from `host_state` (a host copy of this step's
        backend state, such as a rollback snapshot) when given. With `async_ok` the backend's
        files are written in the background: the commit happens in
        `poll_pending`/`finish_pending` once every rank finished; returns None then."""
        self.finish_pending()  # one checkpoint in flight at a time
        started = time.perf_counter()
        final = self.root / step_dir_name(step)
        tmp = self.root / f".tmp-{step_dir_name(step)}"
        if self.rank == 0:
            if tmp.exists():
                shutil.rmtree(tmp)  # left by a crash mid-write: never committed, never loaded
            tmp.mkdir(parents=True)
        barrier()
        own = [f"rng_rank{self.rank}.pt"]
        torch.save(rng_state(), tmp / own[0])
        if self.rank == 0:
            (tmp / "trainer.json").write_text(json.dumps(trainer_state, indent=1))
            (tmp / "config.yaml").write_text(config_yaml)
            own += ["trainer.json", "config.yaml", *copy_into(self.carry, tmp)]
        commit = (step, tmp, final, backend.name, trainer_state["data"], identity, shapes)
        if async_ok:
            written = backend.save_async(tmp, host_state)
            hashes = self._hasher.submit(lambda: self._hashed(tmp, own + written.result(), started))
            self.pending = (hashes, commit, (started, time.perf_counter() - started))
            return None
        mine = self._hashed(tmp, own + backend.save(tmp, host_state), started)
        return self._commit(*commit, mine, (started, None))

    def _hashed(self, tmp: Path, names: list[str], started: float) -> dict[str, Any]:
        hashes = hash_files(tmp, names)
        self.write_s = time.perf_counter() - started
        return hashes

    def poll_pending(self) -> Path | None:
        """Commit the checkpoint in flight if every rank finished writing it (a tiny collective,
        only while one is in flight); the committed path, or None."""
        if self.pending is None:
            return None
        hashes = self.pending[0]
        if not all_true(hashes.done()):
            return None
        return self.finish_pending()

    def finish_pending(self) -> Path | None:
        """Wait for the checkpoint in flight and commit it."""
        if self.pending is None:
            return None
        hashes, commit, timing = self.pending
        self.pending = None
        return self._commit(*commit, hashes.result(), timing)

    def _commit(
        self,
        step: int,
        tmp: Path,
        final: Path,
        backend_name: str,
        data: dict[str, Any],
        identity: dict[str, Any],
        shapes: dict[str, list[int]] | None,
        mine: dict[str, dict[str, Any]],
        timing: tuple[float, float | None],
    ) -> Path:
        """Commit; `timing`: (the save's start, the loop's stall of an asynchronous save or None
        for a synchronous one, whose stall is all of it). `last_save` then says what it cost."""
        parts = all_gather_objects(mine)
        files = {k: v for part in parts for k, v in part.items()}
        started, async_stall = timing
        bytes_per_rank = [sum(f["size"] for f in part.values()) for part in parts]
        if self.rank == 0:
            unlisted = sorted(set(_list_files(tmp)) - set(files))
            assert not unlisted, f"files no rank reported writing: {unlisted}"
            manifest = {
                "step": step,
                "backend": backend_name,
                "world_size": self.world_size,
                "data": data,
                "identity": identity,
                "shapes": shapes,
            }
            write_manifest(tmp, manifest, files)
            if final.exists():
                # An older checkpoint of this step (skipped by resume, or the one a rollback
                # returned to): kept aside, never deleted.
                final.rename(self.root / f"{final.name}.replaced-{time.time_ns()}")
            tmp.rename(final)
            fsync_dir(self.root)
            self._prune()
        barrier()
        seconds = time.perf_counter() - started
        self.last_save = {
            "seconds": round(seconds, 4),  # from the save's start to the commit
            "stall_s": round(seconds if async_stall is None else async_stall, 4),
            "async": async_stall is not None,
            "write_s": round(self.write_s, 4),  # this rank's files written and hashed
            "bytes_per_rank": bytes_per_rank,
        }
        return final

    def retire_after(self, step: int) -> list[str]:
        """Move committed checkpoints newer than `step` aside (a rollback abandoned those steps;
        resuming from one would replay the data the rollback skips). Kept, never deleted."""
        newer = [p for p in self.committed() if int(p.name[len(PREFIX) :]) > step]
        if self.rank == 0:
            for path in newer:
                path.rename(self.root / f"{path.name}.abandoned-{time.time_ns()}")
        barrier()
        return [p.name for p in newer]

    def _prune(self) -> None:
        for old in self.committed()[: -self.keep]:
            shutil.rmtree(old)

    def verify(self, path: Path) -> dict[str, Any]:
        """verify() shared out over the ranks; every rank gets the same answer (or exception)."""
        try:
            manifest = read_manifest(path)
            names = sorted(manifest["files"])
            check_files(
                path, {n: manifest["files"][n] for n in names[self.rank :: self.world_size]}
            )
            error = None
        except CheckpointError as e:
            error = str(e)
        errors = [e for e in all_gather_objects(error) if e]
        if errors:
            raise CheckpointError(errors[0])
        return manifest

    def newest_valid(self, on_invalid=None) -> tuple[Path, dict[str, Any]] | None:
        """The newest committed checkpoint that verifies; `on_invalid(path, reason)` hears of the
        ones skipped on the way."""
        for path in reversed(self.committed()):
            try:
                return path, self.verify(path)
            except CheckpointError as e:
                if on_invalid:
                    on_invalid(path, str(e))
        return None

    def load(self, path: Path, backend) -> dict[str, Any]:
        """Load a verified checkpoint into `backend`; returns the trainer state. Each rank gets its
        own RNG state back, or rank 0's when the world grew. A checkpoint of another backend loads
        through its source (parallel/sources.py): weights, FP32 moments, step counts, and the loss
        scale, which the backends keep in different places. So does a checkpoint of the GPT's
        fused layers from before the split."""
        trainer_state = json.loads((path / "trainer.json").read_text())
        manifest = read_manifest(path)
        written_by = manifest["backend"]
        # The GPT's fused qkv and SwiGLU up of before the split load under today's names, which
        # only a source maps (model/fused.py); a backend's own load expects today's tensors.
        if written_by == backend.name and not is_fused(manifest.get("shapes") or {}):
            backend.load(path)
        else:
            source = checkpoint_source(path, written_by)
            backend.load_from(source, optimizer=True)
            scale = source.loss_scale() or (trainer_state.get("loss_scaler") or {}).get("scale")
            if scale is not None:
                backend.adopt_loss_scale(float(scale))
        rng_file = path / f"rng_rank{self.rank}.pt"
        set_rng_state(
            torch.load(rng_file if rng_file.exists() else path / "rng_rank0.pt", weights_only=True)
        )
        if not rng_file.exists():
            backend.borrowed_rng(int(manifest["step"]))
        return trainer_state


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
