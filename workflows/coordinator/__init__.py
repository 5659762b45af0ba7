"""The Coordinator: one workflow per base model and pool of JAX workers that places every run's adapter, queues each
worker's work and dispatches it as one batch (docs/architecture.md §The workflows).

- `workflow.py`: the `Coordinator` workflow itself (registration, queues, batches, continue-as-new).
- `state.py`: its state, carried across continue-as-new.
- `placement.py`: which worker an item goes to (pure).
- `paging.py`: which adapters are in a worker's slots for a batch, and the page moves that put them there (pure).
- `dispatch.py`: the batches in flight on each worker, the next one queued behind the running one.
- `fairness.py`: the order queued work is taken in, round-robin over sessions.
- `view.py`: what its `describe` query answers.
"""
