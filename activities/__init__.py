"""Temporal activities of the JAX worker: thin, typed, and all they do is convert and call the engine."""
