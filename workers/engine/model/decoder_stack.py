"""The dense families' decoder layers stacked into one module (`DecoderStack`) and the two ways to run them.

`scan` runs every layer as one `jax.lax.scan` over the layer axis: the program holds one layer's computation
whatever the depth, so compile time does not grow with it. Training always scans. But the scan hands each layer its
weights as a dynamic slice of the [L, in, out] stacks, and on a GPU XLA copies that slice into a buffer of its own
before each GEMM (a profile of Qwen3-8B decode: 27% of its time in device-to-device copies; XLA's dynamic slice
fusion flag did not remove them, docs/benchmarks-gpu.md §Decoding), which a memory-bound decode step pays for once
more per weight byte.

`unrolled` is a Python loop over the layers, each taking its weights as a static slice of the stacks
(`a[i]`: a `lax.slice` with constant bounds, not a dynamic slice), for the programs that run with a KV cache (the
sampler's admission and decode: `CausalLM.decode_layers`), so the compiler sees every layer's weights at a fixed
offset in the stack, which it may fuse into the GEMM's operand or schedule with the rest of the layer instead of a
copy per scan step. On CPU XLA still materialises a static slice (a slice-bitcast loop fusion before the dot);
whether a GPU's does is what benchmarks/device_check.py's decode lines measure side by side (`decode_layers`), with
no GPU here to read its compiled program on. Per-layer weight buffers (the
per-layer loop of `scan_layers=False`) would avoid any slice, at the cost of the training scan or of a second copy
of the weights. Unrolling costs compile time that grows with depth, hence `auto` (the engine's option): unrolled on
accelerators, scan on CPU.

The KV cache (kv_cache.LayerCache [L, B, S, kv, hd]) is written in place in both: each layer scatters its keys and
values at cache[i] (decoder_layer.Attention, `write_kv`), the scan with i traced, the unrolled loop with i a
constant; the caller donates the cache (tests/engine/test_decode_layers.py checks the unrolled program's temporary
memory is not a cache per layer)."""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx

from .attention import Segments
from .decoder_layer import AfterLayer, DecoderLayer, constrain
from .families import ModelConfig
from .kv_cache import LayerCache, RowCache
from .remat import Remat, checkpoint

# How the programs that run with a KV cache loop over a stack's layers (module doc); "auto" is the engine's choice
# between them by backend (resolve_decode_layers).
DecodeLayers = Literal["scan", "unrolled"]
DECODE_LAYER_CHOICES = ("scan", "unrolled", "auto")


def resolve_decode_layers(choice: str, backend: str | None = None) -> DecodeLayers:
    """`choice` as the sampler runs it: "auto" is unrolled on an accelerator and scan on CPU, where the tiny models
    gain nothing from unrolling and every compile (CI's) grows with depth."""
    if choice not in DECODE_LAYER_CHOICES:
        raise ValueError(f"decode layers {choice!r}: one of {', '.join(DECODE_LAYER_CHOICES)}")
    if choice == "auto":
        return "scan" if (backend or jax.default_backend()) == "cpu" else "unrolled"
    return "scan" if choice == "scan" else "unrolled"


class DecoderStack(DecoderLayer):
    """`num_layers` identical decoder layers stored as one: every base leaf gains a leading layer axis ([L, ...]),
    every LoRA leaf a layer axis after its adapter axis ([S, L, ...], the adapter axis stays first: see the module
    doc). Built from one layer's (deterministic: zeros, ones) initial values repeated; the loader fills the real
    weights layer by layer. `CausalLM.decode` runs it by `scan` or `unrolled` (module doc); indexing gives one layer
    as a `DecoderLayer` view, its leaves static slices of the stacks (`_layer`)."""

    def __init__(
        self,
        config: ModelConfig,
        mlp: nnx.Module,
        *,
        max_adapters: int,
        max_rank: int,
        rngs: nnx.Rngs,
        param_dtype=jnp.float32,
    ):
        super().__init__(config, mlp, max_adapters=max_adapters, max_rank=max_rank, rngs=rngs, param_dtype=param_dtype)
        self.num_layers = config.num_layers
        n = config.num_layers
        lora, rest = nnx.state(self, nnx.LoRAParam, ...)
        nnx.update(
            self,
            jax.tree.map(lambda x: jnp.repeat(x[:, None], n, axis=1), lora),
            jax.tree.map(lambda x: jnp.repeat(x[None], n, axis=0), rest),
        )

    def __len__(self) -> int:
        return self.num_layers

    def __getitem__(self, i: int) -> DecoderLayer:
        graphdef, lora, rest = nnx.split(self, nnx.LoRAParam, ...)
        return _layer(graphdef, lora, rest, i)

    def __iter__(self):
        return (self[i] for i in range(self.num_layers))

    def scan(
        self,
        x,
        positions,
        rope,
        routing,
        cache: LayerCache | RowCache | None,
        *,
        remat: Remat,
        act_sharding,
        segments: Segments | None = None,
        after_layer: AfterLayer | None = None,
    ):
        """Every layer in order as one `jax.lax.scan` over the layer axis; the cache (all layers') rides in the
        carry and each layer writes its slice in place; `after_layer` as `CausalLM.decode` takes it (its layer
        index traced).

        Gradient checkpointing (`remat`, remat.py): `jax.checkpoint` around the scanned body, so the backward pass
        keeps one [B, T, H] hidden state per layer (the scan's carry) and recomputes the layer's insides from it
        (FULL), or only its elementwise work between the saved matmul outputs (DOTS), as the per-layer
        `checkpointed` of the loop does."""
        graphdef, lora, rest = nnx.split(self, nnx.LoRAParam, ...)
        lora = jax.tree.map(lambda a: jnp.moveaxis(a, 1, 0), lora)  # layer-first for the scan: LoRA-sized copy

        def body(carry, xs):
            x, cache = carry
            carried = x.dtype  # the residual stream's dtype between layers (CausalLM.residual_dtype)
            layer_lora, layer_rest, i = xs
            layer = nnx.merge(graphdef, layer_lora, layer_rest)
            x, cache = DecoderLayer.__call__(layer, x, positions, rope, routing, cache, i, segments)
            if after_layer is not None:
                x = after_layer(i, x)
            return (constrain(x.astype(carried), act_sharding), cache), None

        if cache is None:
            body = checkpoint(body, remat, prevent_cse=False)  # prevent_cse is not needed inside scan (JAX's advice)
        layers = jnp.arange(self.num_layers, dtype=jnp.int32)
        (x, cache), _ = jax.lax.scan(body, (x, cache), (lora, rest, layers))
        return x, cache

    def unrolled(
        self,
        x,
        positions,
        rope,
        routing,
        cache: LayerCache | RowCache | None,
        *,
        act_sharding,
        segments: Segments | None = None,
        after_layer: AfterLayer | None = None,
    ):
        """Every layer in order as a Python loop, layer i on static slices of the stacks (module doc) and writing
        cache[i] in place; `after_layer` as `CausalLM.decode` takes it (its layer index an int). For calls with a
        KV cache only: nothing here checkpoints for a backward pass."""
        graphdef, lora, rest = nnx.split(self, nnx.LoRAParam, ...)
        carried = x.dtype  # the residual stream's dtype between layers (CausalLM.residual_dtype)
        for i in range(self.num_layers):
            layer = _layer(graphdef, lora, rest, i)
            x, cache = DecoderLayer.__call__(layer, x, positions, rope, routing, cache, i, segments)
            if after_layer is not None:
                x = after_layer(i, x)
            x = constrain(x.astype(carried), act_sharding)
        return x, cache


def _layer(graphdef: nnx.GraphDef, lora: Any, rest: Any, i: int) -> DecoderLayer:
    """Layer `i` of a split stack as a `DecoderLayer`: its base leaves a[i], its LoRA leaves a[:, i] (the adapter axis
    first), both static slices (a Python int index: `lax.slice`, never a dynamic slice)."""
    return nnx.merge(graphdef, jax.tree.map(lambda a: a[:, i], lora), jax.tree.map(lambda a: a[i], rest))
