"""The JAX engine: one base model with trainable LoRA slots and sampler snapshots.

At this level, the boundary: `engine.py` (the `Engine` facade), `types.py` (numpy-in, numpy-out types),
`interface.py` (what the activities call) and `validation.py` (each request checked on its own). Below it, one
folder per kind of part: `model/` (the model and its files), `training/` (steps, losses, AdamW, the adapter slots),
`sampling/` (the sampler and its snapshots) and `runtime/` (compilation, the device mesh, multi-host, the lock).
"""
