"""File helpers that checkpoints, exports and prepared data share: hashing, durable writes, the
usual permissions."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from pathlib import Path


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(directory: Path) -> None:
    """Make renames and new files in `directory` durable (where the OS supports it)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json_atomic(path: Path, obj: object) -> None:
    """Write `obj` as JSON to `path` so that a crash leaves the old file or the new one, on disk."""
    # A name of its own: processes that write the same file at once (ranks) do not collide.
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        with tmp.open("x") as f:  # mode 0666 less the umask, like any new file
            json.dump(obj, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def process_umask() -> int:
    """The process's umask. Linux shows it in /proc/self/status; elsewhere it is read by setting
    it, to 0o077 meanwhile, so that a file another thread creates in between is private rather
    than open to all."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def usual_permissions(path: Path) -> None:
    """Give `path`, and everything under a directory, the mode open() or mkdir() would have
    given it under the process's umask (0644 and 0755 under umask 022). Some writers make
    private files of their own accord (safetensors' save_file: 0600; tempfile.mkdtemp: 0700):
    a checkpoint or an exported model nobody else could read."""
    mask = process_umask()
    for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
        if not p.is_symlink():
            p.chmod((0o777 if p.is_dir() else 0o666) & ~mask)
