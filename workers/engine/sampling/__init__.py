"""Sampling: the slot sampler and its device programs, sampling requests and their checks, and sampler snapshots."""
