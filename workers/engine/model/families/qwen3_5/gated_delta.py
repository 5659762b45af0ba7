"""The gated delta rule, Gated DeltaNet's token mixer, as pure JAX functions.

Per row and value head, a state S [dk, dv] runs over the tokens (transformers' `torch_recurrent_gated_delta_rule`):

    S <- exp(g_t) S;   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T (scale q_t)

with g_t <= 0 the log decay, beta_t in (0, 1) the write strength, q/k l2-normalised by the caller and scale
dk ** -0.5. Query/key heads are already repeated to the value heads.

Three forms of it:

* `chunk_gated_delta_rule` (training and prefill): the tokens in chunks of C (64), each chunk in the parallel form
  of DeltaNet's WY/UT transform (the chunk's C writes folded into one unit-lower-triangular solve, then matmuls), and
  the state carried from chunk to chunk by `jax.lax.scan`. Work is O(T C (dk + dv) + T dk dv): linear in length, as
  is memory. Lengths that are not a multiple of C are padded internally with no-op tokens (g = 0, beta = 0).
* `recurrent_gated_delta_rule`: a scan of `gated_delta_step` over the tokens: the definition itself, the reference
  the chunked form is tested against (values and gradients).
* `gated_delta_step`: one token per row, for decoding against a cached state.

Packed rows (segment ids as `attention.Segments`, read through `segments.runs`): the state resets where a segment
starts. The chunked form never writes a -inf decay (a chunk's sums of log decays would turn into inf - inf); it
masks instead: within a chunk every pairwise term is kept only between tokens of one run, a token reads the state
carried into its chunk only if its run continues the previous chunk's last run, and the state leaving a chunk holds
only the writes of the chunk's last run. Padding tokens are no-ops (g = 0, beta = 0) and answer zero.

An initial state goes in and the final state (after the row's last real token) comes out of every form, so a prompt
can be prefilled in chunks and decoding can resume from a snapshot.

Gradients are left to autodiff: the scan saves its carry once per chunk (T / C states of dk x dv per head) next to
the per-chunk products, all linear in T, so neither `jax.checkpoint` nor a custom VJP is needed for linear memory
(tests/engine/test_qwen3_5_gated_delta.py bounds the compiled backward's memory as the length grows).

Numerics: float32 throughout, and the matmuls at HIGHEST precision: on GPUs the default float32 matmul is TF32,
whose 10-bit mantissa the triangular solve would amplify over a chunk.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .segments import runs

_HIGHEST = jax.lax.Precision.HIGHEST


def _mm(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.einsum(spec, a, b, precision=_HIGHEST, preferred_element_type=jnp.float32)


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x / sqrt(sum(x^2) + eps) over the last axis, in float32 (transformers' and flash-linear-attention's l2norm)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _segment_sums(g: jax.Array, strict: jax.Array) -> jax.Array:
    """out[..., i, j] = sum of g[..., t] over j < t <= i (zero for i <= j), for g [..., C].

    Summed directly, as Mamba-2's stable `segsum`, not as cumsum_i - cumsum_j: the difference of two long sums
    loses the low bits of a short one (the decays that matter), and its gradient is a difference of large sums
    too, which left float32 residues of 2^-21 in d/dg where the true value is ~1e-12."""
    c = g.shape[-1]
    terms = jnp.where(strict, jnp.broadcast_to(g[..., :, None], (*g.shape, c)), 0.0)  # [t, j]: g_t for t > j
    return jnp.cumsum(terms, axis=-2)


def _prepare(q, k, v, g, beta, segment_ids, scale):
    """Float32 inputs, q scaled, padding made a no-op; and the run id of every token ([B, T], zeros unpacked)."""
    b, t, _, dk = q.shape
    q, k, v, g, beta = (x.astype(jnp.float32) for x in (q, k, v, g, beta))
    q = q * (dk**-0.5 if scale is None else scale)
    if segment_ids is None:
        return q, k, v, g, beta, jnp.zeros((b, t), jnp.int32)
    real = (segment_ids > 0)[..., None]
    return q, k, v, jnp.where(real, g, 0.0), jnp.where(real, beta, 0.0), runs(segment_ids)


def _initial(initial_state: jax.Array | None, b: int, h: int, dk: int, dv: int) -> jax.Array:
    if initial_state is None:
        return jnp.zeros((b, h, dk, dv), jnp.float32)
    return initial_state.astype(jnp.float32)


def _zero_padding(out: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
    return out if segment_ids is None else jnp.where((segment_ids > 0)[..., None, None], out, 0.0)


def gated_delta_step(
    state: jax.Array,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    scale: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """One token per row: state [B, H, dk, dv], q/k [B, H, dk], v [B, H, dv], g/beta [B, H] ->
    (output float32 [B, H, dv], new state float32 [B, H, dk, dv])."""
    factor = q.shape[-1] ** -0.5 if scale is None else scale
    k, v = k.astype(jnp.float32), v.astype(jnp.float32)
    s = state.astype(jnp.float32) * jnp.exp(g.astype(jnp.float32))[..., None, None]
    delta = (v - _mm("bhkv,bhk->bhv", s, k)) * beta.astype(jnp.float32)[..., None]
    s = s + k[..., :, None] * delta[..., None, :]
    return _mm("bhkv,bhk->bhv", s, q.astype(jnp.float32) * factor), s


def recurrent_gated_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    segment_ids: jax.Array | None = None,
    initial_state: jax.Array | None = None,
    scale: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Token by token (the definition; arguments and results as `chunk_gated_delta_rule`)."""
    b, _, h, dk = q.shape
    dv = v.shape[-1]
    q, k, v, g, beta, run = _prepare(q, k, v, g, beta, segment_ids, scale)
    restart = jnp.concatenate([jnp.zeros((b, 1), bool), run[:, 1:] != run[:, :-1]], axis=1)

    def step(s, xs):
        q_t, k_t, v_t, g_t, beta_t, restart_t = xs
        s = jnp.where(restart_t[:, None, None, None], 0.0, s)
        out, s = gated_delta_step(s, q_t, k_t, v_t, g_t, beta_t, scale=1.0)
        return s, out

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta, restart))
    final, out = jax.lax.scan(step, _initial(initial_state, b, h, dk, dv), xs)
    return _zero_padding(jnp.moveaxis(out, 0, 1), segment_ids), final


def chunk_gated_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    segment_ids: jax.Array | None = None,
    initial_state: jax.Array | None = None,
    chunk_size: int = 64,
    scale: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The chunked form (module docstring).

    q/k [B, T, H, dk], v [B, T, H, dv], g/beta [B, T, H]; `segment_ids` int32 [B, T] (None: each row one sequence,
    every token real); `initial_state` [B, H, dk, dv] (None: zeros) continues each row's first segment. Returns the
    output float32 [B, T, H, dv] (zero at padding) and the state after each row's last token, float32
    [B, H, dk, dv]."""
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    q, k, v, g, beta, run = _prepare(q, k, v, g, beta, segment_ids, scale)
    c = chunk_size
    n = -(-t // c)
    pad = n * c - t
    if pad:  # no-op tokens, continuing the last run so the final state is the last real token's
        q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
        g, beta = (jnp.pad(x, ((0, 0), (0, pad), (0, 0))) for x in (g, beta))
        run = jnp.pad(run, ((0, 0), (0, pad)), mode="edge")

    def chunked(x):  # [B, N*C, H, ...] -> [B, H, N, C, ...]
        return jnp.moveaxis(x.reshape(b, n, c, h, *x.shape[3:]), 3, 1)

    q, k, v, g, beta = (chunked(x) for x in (q, k, v, g, beta))
    run = run.reshape(b, 1, n, c)  # one head axis, broadcast
    prev = jnp.concatenate([jnp.zeros((b, 1, 1), jnp.int32), run[:, :, :-1, -1]], axis=2)
    carried = run == prev[..., None]  # [B, 1, N, C]: the token's run continues the state carried into the chunk
    in_last = run == run[..., -1:]  # the token's run is the one the chunk hands on
    same = run[..., :, None] == run[..., None, :]
    causal = jnp.tril(jnp.ones((c, c), bool))
    strict = jnp.tril(jnp.ones((c, c), bool), -1)

    cum = jnp.cumsum(g, axis=-1)  # [B, H, N, C]: log decay from the chunk's start through each token
    between = _segment_sums(g, strict)  # [B, H, N, C, C]: log decay after token j through token i
    # decay[i, j] for j <= i in one run; masked before the exp, so nothing overflows
    decay = jnp.exp(jnp.where(causal & same, between, -jnp.inf))
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    # (I + L) X = rhs with L[i, j] = beta_i k_i.k_j decay[i, j], j < i: u (the writes' values) and w (the keys that
    # read the carried state), each token's write corrected for the writes before it in the chunk
    lower = jnp.where(strict, _mm("...id,...jd->...ij", k_beta, k) * decay, 0.0)
    from_start = jnp.exp(cum) * carried
    rhs = jnp.concatenate([v_beta, k_beta * from_start[..., None]], axis=-1)
    solved = jax.lax.linalg.triangular_solve(lower, rhs, left_side=True, lower=True, unit_diagonal=True)
    u, w = solved[..., :dv], solved[..., dv:]
    attn = _mm("...id,...jd->...ij", q, k) * decay  # within the chunk, the diagonal included
    q_read = q * from_start[..., None]
    k_write = k * (jnp.exp(between[..., -1, :]) * in_last)[..., None]
    state_decay = jnp.exp(cum[..., -1]) * carried[..., -1]  # [B, H, N]

    def step(s, xs):
        u_n, w_n, q_n, k_n, attn_n, decay_n = xs
        v_new = u_n - _mm("bhck,bhkv->bhcv", w_n, s)
        out = _mm("bhck,bhkv->bhcv", q_n, s) + _mm("bhij,bhjv->bhiv", attn_n, v_new)
        return s * decay_n[..., None, None] + _mm("bhck,bhcv->bhkv", k_n, v_new), out

    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (u, w, q_read, k_write, attn, state_decay))
    final, out = jax.lax.scan(step, _initial(initial_state, b, h, dk, dv), xs)  # out [N, B, H, C, dv]
    out = jnp.transpose(out, (1, 0, 3, 2, 4)).reshape(b, n * c, h, dv)[:, :t]
    return _zero_padding(out, segment_ids), final
