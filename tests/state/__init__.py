"""Tests of bigtrain/state: the run's one typed state."""
