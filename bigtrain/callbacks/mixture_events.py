"""Mixture sources in the run's events: `source_exhausted` when the data cursor passes the last
draw of a source that reached its `max_epochs` (data/read/mixture.py decides where that is)."""

from __future__ import annotations

from bigtrain.data.read.mixture import MixtureStream
from bigtrain.train.hooks import Callback
from bigtrain.train.step import StepResult


class SourceEvents(Callback):
    """Compares the cursor before and after each step with the positions where sources end; a
    resumed run does not repeat the events of positions its checkpoint had passed."""

    def __init__(self) -> None:
        self.cursor = 0
        self.reported: set[str] = set()  # a rollback that moves the cursor back does not repeat

    def on_start(self, trainer) -> None:
        self.cursor = trainer.loader.stream.cursor

    def on_step_end(self, trainer, result: StepResult) -> None:
        stream = trainer.loader.stream
        assert isinstance(stream, MixtureStream)
        for spec, position in stream.exhaustions():
            if self.cursor < position <= stream.cursor and spec.name not in self.reported:
                self.reported.add(spec.name)
                trainer.event(
                    "source_exhausted",
                    source=spec.name,
                    position=position,
                    epochs=spec.max_epochs,
                    samples=spec.cap,
                    num_samples=spec.num_samples,
                )
        self.cursor = stream.cursor
