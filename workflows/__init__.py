"""Temporal workflows: SessionWorkflow, TrainingRunWorkflow, Coordinator, SampleRequestWorkflow, CheckpointExpiry,
StoreJanitor. The Coordinator and the policies it runs on are the package `coordinator/`; the protocol the API, the
workflows and the activities speak (messages, work items, names, error types) is the package `protocol/`.

Deterministic and light by rule (docs/architecture.md §The workflows): nothing in this package imports jax or numpy
or does I/O."""
