"""Process entry points (workflow worker, JAX worker) and, in `engine/`, the JAX engine the JAX worker hosts."""
