"""Every replica group's weights compared: a digest of each rank's shards (rank r of every group
holds the same shards), the groups' digests side by side, and the groups that differ from the
most common weights."""

from __future__ import annotations

import hashlib

import torch

from bigtrain.parallel.backends.base import Backend
from bigtrain.utils.tensors import local_tensor


def local_digest(backend: Backend) -> bytes:
    """sha256 of this rank's FP32 master tensors in order. Rank r of every replica group holds
    the same shards, so equal digests on every rank mean equal weights (a host copy of the
    shards: after persistent checkpoints and at the end only)."""
    digest = hashlib.sha256()
    for tensor in backend.master_state()[0]:
        host = local_tensor(tensor).detach().contiguous().cpu()
        digest.update(host.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.digest()


def weight_groups(by_rank: list[dict[int, str]]) -> dict[int, tuple[str, ...]]:
    """Each group's weights as the tuple of its ranks' digests (every rank of this group
    exchanged its own shard's digest with the same rank of the other groups)."""
    groups = sorted(set.intersection(*(set(d) for d in by_rank)))
    return {g: tuple(d[g] for d in by_rank) for g in groups}


def odd_groups(weights: dict[int, tuple[str, ...]], leading: int | None) -> list[int]:
    """The groups whose weights differ from the most common ones (on a tie, from those of the
    leading group, which writes the checkpoints)."""
    counts: dict[tuple[str, ...], int] = {}
    for w in weights.values():
        counts[w] = counts.get(w, 0) + 1
    top = max(counts.values())
    common = [w for w, n in counts.items() if n == top]
    reference = weights[leading] if leading in weights and weights[leading] in common else common[0]
    return sorted(g for g, w in weights.items() if w != reference)
