"""Parallelism: process environment and the backends behind one protocol."""
