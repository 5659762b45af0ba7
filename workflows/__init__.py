"""Temporal workflows: SessionWorkflow, TrainingRunWorkflow, Coordinator, SampleRequestWorkflow, CheckpointExpiry,
StoreJanitor; the typed protocol they speak (work.py, messages.py). The Coordinator and the policies it runs on are
the package `coordinator/`.

Deterministic and light by rule (docs/architecture.md §The workflows): nothing in this package imports jax or numpy
or does I/O."""
