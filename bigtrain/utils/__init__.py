"""Helpers that several layers share (tensor tables for kernels, ...); imports nothing of bigtrain."""
