"""The JAX engine: one base model with trainable LoRA slots and sampler snapshots.

Its floors, each importing only those below it (tests/test_import_rules.py holds them):

* the vocabulary: `types.py` (numpy-in, numpy-out types), `interface.py` (what the activities call) and
  `shape_buckets.py` (the lengths and row counts programs are compiled for);
* `model/`: the model and its files, and how its parameters lie on the device mesh (`model/sharding.py`);
* `runtime/`: compilation caches, the program budget, the memory plan, the paging store;
* `training/`: steps, losses, AdamW, the adapter slots, a forward_backward's datum checks;
* `sampling/`: the sampler, its snapshots, a sample request's checks;
* at the top, the engine as a whole: `engine.py` (the `Engine` facade over `engine_parts.py`), `warm_up.py`
  (what is compiled ahead of traffic), `engine_lock.py` (one call at a time, a background warm-up between them) and
  `multihost.py` (one engine over several processes).
"""
