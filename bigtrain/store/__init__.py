"""What a run keeps on disk: the run directory and its lock, checkpoints and their manifests."""
