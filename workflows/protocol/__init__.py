"""The protocol between the API, the workflows and the JAX worker's activities: the bottom layer every other imports
(tests/test_import_rules.py). Workflow code, so stdlib and temporalio only, and pure data: no state, no I/O, no clock.

- `work.py`: the vocabulary of engine work: the kinds (`WorkKind`, `OpKind`), the LoRA and Adam specs and one small
  frozen dataclass of parameters per kind, with the readers of the legacy `params` dicts.
- `messages.py`: the envelopes Temporal carries, built from that vocabulary: `WorkItem`, `Batch`, `Outcome`, the
  workflows' start arguments and states, `BlobRef` into the claim-check store.
- `names.py`: what a person sees in the Temporal UI and code finds things by: workflow ids, task queues, search
  attributes.
- `errors.py`: the `type` of every ApplicationError raised on purpose (`ErrorType`).
- `usage.py`: metered usage (`OpUsage`) and the hourly ledger it is added to.
"""
