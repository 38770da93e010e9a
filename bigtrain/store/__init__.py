"""The run directory: its files (config, metrics, events, final.json) and its lock against a
second live run (rundir.py, runlock.py). Checkpoints under it are bigtrain/checkpoint's."""
