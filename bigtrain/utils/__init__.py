"""Helpers that several layers share: canonical names, host copies and local shards of tensors,
collectives that also work in one process, clocks, files, logging, sizes, tables for kernels;
imports nothing else of bigtrain."""
