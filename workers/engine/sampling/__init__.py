"""Sampling: the slot sampler and its device programs, sampling requests, and sampler snapshots."""
