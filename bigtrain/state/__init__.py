"""The run's state: one typed assembly of the parts of a run that change as it trains (run.py:
RunState over the backend's tensors, the counters, the data cursor, the RNG and every Stateful part
the run registers: clipping, the detector's windows, the loss scale, callbacks, replica groups, the
healer's bookkeeping). Checkpoints, a rejoining replica group's transfer and rollback snapshots all
take it from here, so they hold the same parts; the modules that act on a run (replica groups,
healing) receive this object and an event sink (events.py), never the trainer."""

from bigtrain.state.events import Events
from bigtrain.state.run import Cadence, Counters, Held, RunState, Stateful

__all__ = ["Cadence", "Counters", "Events", "Held", "RunState", "Stateful"]
