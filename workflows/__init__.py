"""Temporal workflows: SessionWorkflow, TrainingRunWorkflow, Coordinator, SampleRequestWorkflow.

Deterministic and light by rule (DESIGN §2, house rule 6): nothing in this package imports jax or numpy or does I/O.
"""
