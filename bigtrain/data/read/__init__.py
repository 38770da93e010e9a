"""Token shards to batches: a prepared directory read as one token array (prepared.py), the
sources of `data.mixture` opened and checked together (sources.py), weighted mixtures that say
which source and sample each global position holds (mixture.py), and the deterministic,
resumable, skippable sample stream and batch loader of each data-parallel rank (stream.py)."""
