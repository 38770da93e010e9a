"""What corpus a run trains on, or `bigtrain prepare` read: logged once and written in the `start`
event, so that a run on other data than meant says so at its first line."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

MAX_EVENT_INPUTS = 100
"""Inputs listed in an event (a corpus may be thousands of files; the count is always there)."""
_SHOWN = 3  # inputs named in the log line
_NOUNS = {
    "files": ("file", "files"),
    "shakespeare": ("file", "files"),
    "hub": ("hub dataset", "hub datasets"),
    "prepared": ("prepared directory", "prepared directories"),
}


@dataclass(frozen=True)
class CorpusSummary:
    """Which corpus, by data.source, what it read, and how much."""

    source: str
    """data.source."""
    inputs: list[str]
    """What was read: the files of data.paths in order (source=files), the plays' files
    (shakespeare), the dataset and its split (hub), the directories of data.mixture (prepared)."""
    num_documents: int
    num_tokens: int
    """Documents and tokens (EOS included) of the whole corpus; with source=prepared, of the
    training sources, their held-out tails included."""

    def describe(self) -> str:
        """One line: `source=files, 2 files under data/ (a.txt, b.txt): 12 documents, 3,456
        tokens`; files are named from their common directory, the first few only."""
        one, many = _NOUNS.get(self.source, ("input", "inputs"))
        names, where = self.inputs, ""
        if self.source in ("files", "shakespeare") and len(self.inputs) > 1:
            common = os.path.commonpath(self.inputs)
            if common not in ("", "/"):
                names = [os.path.relpath(p, common) for p in self.inputs]
                where = f" under {common}"
        shown = ", ".join(names[:_SHOWN])
        if len(names) > _SHOWN:
            shown += f", ... {len(names) - _SHOWN} more"
        noun = one if len(self.inputs) == 1 else many
        documents = "document" if self.num_documents == 1 else "documents"
        return (
            f"source={self.source}, {len(self.inputs)} {noun}{where} ({shown}): "
            f"{self.num_documents:,} {documents}, {self.num_tokens:,} tokens"
        )

    def to_event(self) -> dict[str, Any]:
        """The `corpus` of the `start` event (the first MAX_EVENT_INPUTS inputs)."""
        return {
            "source": self.source,
            "inputs": self.inputs[:MAX_EVENT_INPUTS],
            "num_inputs": len(self.inputs),
            "num_documents": self.num_documents,
            "num_tokens": self.num_tokens,
        }
