"""Which tokens of a sequence each cp rank holds.

The sequence is cut into equal chunks. `all_to_all` gives rank r chunk r of `degree` chunks
(attention then runs over the whole sequence for a share of the heads, so every rank does the
same work whatever its chunk). `ring` cuts it into 2 x degree chunks and gives rank r chunks r
and 2 x degree - 1 - r: with causal attention a late chunk sees more keys than an early one, and
this pairing gives every rank one of each, so every step of the ring does the same work on
every rank (the load balance of Megatron-Core's and torch's rings).

Every cp rank of a data-parallel rank reads the whole batch slice (token ids are a few bytes a
token) and cuts it here: the positions and document boundaries of the whole sequence are known
on every rank, so a chunk's true positions (RoPE, learned positions) and each pair of chunks'
document mask come from the same ids everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

STYLES = ("ring", "all_to_all")


@dataclass(frozen=True)
class ContextSplit:
    """The cp ranks of one model copy: how many, which one this is, how the sequence is cut,
    and their process group (None in a planned layout, or with degree 1)."""

    degree: int
    rank: int
    style: str
    group: dist.ProcessGroup | None = field(default=None, compare=False, repr=False)

    @property
    def pieces(self) -> int:
        """Chunks the sequence is cut into."""
        return 2 * self.degree if self.style == "ring" else self.degree

    def chunk_ids(self, rank: int | None = None) -> tuple[int, ...]:
        """The chunks `rank` (default: this one) holds, in the order it holds them."""
        r = self.rank if rank is None else rank
        return (r, 2 * self.degree - 1 - r) if self.style == "ring" else (r,)

    def chunk_len(self, seq: int) -> int:
        assert seq % self.pieces == 0, "config/parallel.py checks model.seq_len"
        return seq // self.pieces

    def local(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's chunks of a tensor holding the whole sequence along `dim`, concatenated
        in chunk_ids order."""
        if self.degree == 1:
            return t
        n = self.chunk_len(t.shape[dim])
        parts = [t.narrow(dim, i * n, n) for i in self.chunk_ids()]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)

    def positions(self, seq: int, device: torch.device | str) -> torch.Tensor:
        """The true positions of this rank's tokens in a sequence of `seq` (1-D)."""
        return self.local(torch.arange(seq, device=device), dim=0)

    def chunk(self, full: torch.Tensor, chunk_id: int, dim: int = 1) -> torch.Tensor:
        """Chunk `chunk_id` of a tensor holding the whole sequence along `dim`."""
        n = self.chunk_len(full.shape[dim])
        return full.narrow(dim, chunk_id * n, n)

    def gather(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The whole sequence from every cp rank's `local` part (a collective of the cp ranks;
        for what needs every position, such as the samples' next-token logits)."""
        if self.degree == 1:
            return t
        parts = [torch.empty_like(t) for _ in range(self.degree)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        n = t.shape[dim] // len(self.chunk_ids())
        chunks: list[torch.Tensor] = [t] * self.pieces
        for rank, part in enumerate(parts):
            for slot, chunk_id in enumerate(self.chunk_ids(rank)):
                chunks[chunk_id] = part.narrow(dim, slot * n, n)
        return torch.cat(chunks, dim=dim)

    def peer(self, offset: int) -> int:
        """The global rank `offset` places further round this rank's cp group."""
        local = (self.rank + offset) % self.degree
        return dist.get_global_rank(self.group, local) if self.group is not None else local
