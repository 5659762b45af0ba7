"""What an admission computes on a prompt besides its KV cache, on the device: the log-probs of chosen token ids at
chosen positions (`target_prompt_logprobs`) and tokens drawn from the model's next-token distribution at every
position (`prompt_alt_tokens_k`).

Both read the vocabulary in chunks of positions (`logprobs._chunked`), so a long prompt's logits never exist whole.
Log-probs are log_softmax of the unmodified logits, the quantity the trainer computes (as for sampled tokens); the
draws are at the row's temperature (0: the most likely token, k times). A row's draws depend only on its seed and the
position: stream `ALT_STREAM` of the seed, apart from the sampled tokens' (token_choice._uniforms).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ..model.logprobs import _chunked

# Folded into a row's seed for its prompt draws, so they never repeat its sampled tokens' randomness.
ALT_STREAM = 0x5A17


def target_prompt_logprobs(model: Any, h: jax.Array, targets: jax.Array, routing: Any, chunk: int) -> jax.Array:
    """float32 [R, T, K]: log p(targets[r, t, j]) at the position after t, from hidden states h [R, T, H] and
    target ids [R, T, K] (-1: none, answered 0)."""

    def one(hx, tx):
        logits = model.logits(hx, routing)
        lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
        got = jnp.take_along_axis(logits, jnp.maximum(tx, 0), axis=-1) - lse
        return jnp.where(tx >= 0, got, 0.0)

    return _chunked(one, h, targets, chunk)


def alt_tokens(
    model: Any,
    h: jax.Array,
    routing: Any,
    k: int,
    temperature: jax.Array,
    seed: jax.Array,
    chunk: int,
    positions: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """k tokens drawn at every position of h [R, T, H] (ids int32 [R, T, k], their log-probs float32), each drawn
    from the row's seed words [R, 2] and its prompt position (`positions` [R, T]), independently, at each row's
    temperature [R] (module docstring)."""

    def one(hx, px):
        logits = model.logits(hx, routing)  # [R, c, V]
        logp = jax.nn.log_softmax(logits, axis=-1)
        scaled = logits / jnp.maximum(temperature, 1e-6)[:, None, None]

        def draw(seed_r, pos, scaled_r):  # one row: positions [c], logits [c, V] -> ids [c, k]
            def at(p, s):
                key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed_r[0]), seed_r[1]), ALT_STREAM)
                return jax.random.categorical(jax.random.fold_in(key, p), s, shape=(k,))

            return jax.vmap(at)(pos, scaled_r)

        ids = jax.vmap(draw)(seed, px, scaled)
        greedy = jnp.broadcast_to(jnp.argmax(logits, axis=-1)[..., None], ids.shape)
        ids = jnp.where((temperature == 0)[:, None, None], greedy, ids).astype(jnp.int32)
        lps = jnp.take_along_axis(logp, ids, axis=-1)
        return jnp.concatenate([ids.astype(jnp.float32), lps], axis=-1)  # ids exact in float32 below 2**24

    packed = _chunked(one, h, positions, chunk)
    return packed[..., :k].astype(jnp.int32), packed[..., k:]
