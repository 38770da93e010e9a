"""Checkpoints committed atomically: save, commit, prune, verify and load.

A checkpoint is written into `checkpoints/.tmp-step_XXXXXXXX/`: the backend's tensors in the one
DCP format (checkpoint/state.py), `backend.json` (the loss scale and what the backend keeps
beside its tensors), `trainer.json`, `config.yaml`, each rank's RNG state and the carried files;
every file fsynced, then `manifest.json` last (checkpoint/manifest.py), and the directory is
renamed to `step_XXXXXXXX`. A crash during a write leaves at most a stale `.tmp-*` directory,
which the next save removes.

Each rank fsyncs and hashes the files it wrote itself. The backend's tensors go through
state_io.py (the backend only says what it holds). Asynchronously (`save(..., async_ok=True)`)
its state is copied to host memory and written in the background; this rank's hashing
follows there too, and the commit (gather the hashes, manifest, rename) happens at a later step
boundary once every rank's background work is done (`poll_pending`).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from bigtrain.checkpoint.manifest import (
    LEGACY_FORMAT_VERSION,
    MANIFEST,
    PREFIX,
    CheckpointError,
    check_files,
    checkpoint_path,
    committed_dirs,
    copy_into,
    hash_files,
    list_files,
    read_manifest,
    step_dir_name,
    verify,
    write_manifest,
)
from bigtrain.checkpoint.rng import rng_state, set_rng_state
from bigtrain.checkpoint.state import CheckpointReader
from bigtrain.checkpoint.state_io import StateIO
from bigtrain.utils.dist import all_gather_objects, all_true, barrier
from bigtrain.utils.files import fsync_dir

logger = logging.getLogger(__name__)


class CheckpointManager:
    """Saves, lists, verifies and loads the checkpoints under `root` (out_dir/checkpoints).

    Every rank calls save/verify/load together. The directory must be shared by all ranks (as it
    is for DCP and DeepSpeed): each rank writes and hashes its part, rank 0 writes the manifest and
    commits by rename once every rank is done."""

    def __init__(
        self, root: Path, keep: int, rank: int = 0, world_size: int = 1, io: StateIO | None = None
    ) -> None:
        self.root, self.keep, self.rank, self.world_size = root, keep, rank, world_size
        self.io = io or StateIO()  # the backend's tensors, written and read
        self.pending: tuple[Future, tuple] | None = None  # (hashes of an async save, commit args)
        self.carry: list[Path] = []
        """Files and directories of the run that each checkpoint carries a copy of (the
        tokenizer, a transformers model's config), so that an export or a conversion needs
        nothing but the checkpoint."""
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="bigtrain-ckpt-hash")
        self.write_s = 0.0  # this rank's last save: its start to its files written and hashed
        self.last_save: dict[str, Any] = {}  # what the last commit cost (_commit)

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
        own = [f"rng_rank{self.rank}.pt", f"local_rank{self.rank}.pt"]
        torch.save(rng_state(), tmp / own[0])
        torch.save(trainer_state.get("local", {}), tmp / own[1])  # this rank's own state
        if self.rank == 0:
            shared = {k: v for k, v in trainer_state.items() if k != "local"}
            (tmp / "trainer.json").write_text(json.dumps(shared, indent=1))
            (tmp / "config.yaml").write_text(config_yaml)
            saved = {"backend": backend.name, "loss_scale": backend.loss_scale()}
            (tmp / "backend.json").write_text(json.dumps(saved | backend.extra_state(), indent=1))
            own += ["trainer.json", "config.yaml", "backend.json", *copy_into(self.carry, tmp)]
        commit = (step, tmp, final, backend.name, trainer_state["data"], identity, shapes)
        if async_ok:
            written = self.io.save_async(backend, tmp, host_state)
            hashes = self._hasher.submit(lambda: self._hashed(tmp, own, written.result(), started))
            self.pending = (hashes, commit, (started, time.perf_counter() - started))
            return None
        mine = self._hashed(tmp, own, self.io.save(backend, tmp, host_state), started)
        return self._commit(*commit, mine, (started, None))

    def _hashed(
        self, tmp: Path, names: list[str], written: dict[str, str], started: float
    ) -> dict[str, Any]:
        """Every file this rank wrote, fsynced, with its size and sha256 (`written`: the backend's
        files, hashed as they were written)."""
        hashes = hash_files(tmp, names, written)
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
            unlisted = sorted(set(list_files(tmp)) - set(files))
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
        """Load a verified checkpoint into `backend`; returns the trainer state. Any backend,
        world size and mesh loads any checkpoint (DCP reshards, checkpoint/state.py). Each rank
        gets its own RNG state back, or rank 0's when the world grew, and its own local state
        (the suspicion tier's shard history, monitor/shards.py) at the same world size. What a
        backend keeps beside its tensors (`backend.json`) goes back to the same backend; another
        takes over its loss scale."""
        manifest = read_manifest(path)
        refuse_legacy(path, manifest)
        trainer_state = json.loads((path / "trainer.json").read_text())
        self.io.load(backend, path)
        saved = json.loads((path / "backend.json").read_text())
        if saved["backend"] == backend.name:
            backend.load_extra_state(saved)
        elif saved.get("loss_scale") is not None:
            backend.adopt_loss_scale(float(saved["loss_scale"]))
        rng_file = path / f"rng_rank{self.rank}.pt"
        set_rng_state(
            torch.load(rng_file if rng_file.exists() else path / "rng_rank0.pt", weights_only=True)
        )
        if not rng_file.exists():
            backend.borrowed_rng(int(manifest["step"]))
        local = path / f"local_rank{self.rank}.pt"  # another world size shards otherwise
        if local.exists() and manifest["world_size"] == self.world_size:
            trainer_state["local"] = torch.load(local, weights_only=True, map_location="cpu")
        return trainer_state

    def load_weights(self, path: Path, backend) -> None:
        """The model weights and buffers of a verified checkpoint, with a fresh optimizer: a new
        run from them (model.init_from)."""
        self.io.load(backend, path, optimizer=False)

    @staticmethod
    def saved_config(path: Path) -> str:
        """The config a checkpoint was written with, as its YAML text."""
        return (path / "config.yaml").read_text()


def refuse_legacy(path: Path, manifest: dict[str, Any]) -> None:
    """CheckpointError (exit 2) for a checkpoint in an earlier version's format: converted once
    by `bigtrain ckpt convert` (checkpoint/convert.py), never read by the load path."""
    if manifest["format_version"] == LEGACY_FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint '{path}' is in the format of an earlier bigtrain version (written by "
            f"its {manifest['backend']} backend); convert it once with `bigtrain ckpt convert "
            f"{path} NEW_DIR`, then resume or start from NEW_DIR"
        )


def open_checkpoint(path: Path) -> tuple[Path, dict[str, Any], CheckpointReader]:
    """The checkpoint a user's path names (a run directory: its newest committed one), verified,
    its manifest, and a reader of its tensors by canonical name (export, generate)."""
    path = checkpoint_path(path)
    manifest = verify(path)
    refuse_legacy(path, manifest)
    return path, manifest, CheckpointReader(path)


def corrupt_newest_checkpoint(root: Path, run_dir: Path) -> str | None:
    """The drill.corrupt_checkpoint drill: flip bytes in the largest file of the newest committed
    checkpoint under `root`, once per run directory (rank 0 only), so that verification finds it
    and resume falls back. Returns the file corrupted, or None."""
    marker = run_dir / ".fault-corrupted-checkpoint"
    dirs = committed_dirs(root)
    if marker.exists() or not dirs:
        return None
    files = [p for p in dirs[-1].rglob("*") if p.is_file() and p.name != MANIFEST]
    target = max(files, key=lambda p: p.stat().st_size)
    data = bytearray(target.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 16] = bytes(b ^ 0xFF for b in data[middle : middle + 16])
    target.write_bytes(bytes(data))
    marker.write_text(str(target) + "\n")
    return str(target)
