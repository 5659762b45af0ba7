"""The sampler's compiled programs (decode.py's admission, decode chunk and empty slots), each behind its AOT cache,
and the device arrays each call of them takes; which programs to build when, and the loop that runs them, are
sampler.py's."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..model.decoder_stack import DecodeLayers
from ..model.families import ModelConfig
from ..model.image_inputs import PromptImages, feature_width, takes_images
from ..model.sharding import DeviceLayout
from ..runtime.aot_cache import AotCache
from . import admission
from .admission import Admission, Chunk
from .buckets import SlotBucket
from .decode import Slots, admit, decode, empty_slots
from .prompt_images import RowImages, blank_images, chunk_images, row_images, tower, visual
from .rows import SampleRow


def stack_size(lora: Any) -> int:
    """How many snapshot LoRAs the stack holds: one axis of every sampler program's shapes."""
    return int(jax.tree.leaves(lora)[0].shape[0])


class SamplerPrograms:
    """The admission, decode-chunk and empty-slots programs: called, or only compiled (`compile_only`)."""

    def __init__(self, graphdef: nnx.GraphDef, placement: DeviceLayout, config: ModelConfig, dtype: Any):
        self.placement = placement
        self.admit = AotCache("sample_admit", partial(admit, graphdef, placement), donate=("slots", "pool"))
        self.decode = AotCache("sample_decode", partial(decode, graphdef, placement), donate=("slots",))
        self.empty = AotCache("sample_slots", partial(empty_slots, config, dtype, placement))
        # The tower's graph is read when its program is traced (`_visual` sets it first): it is the same graph at
        # every call, so its programs key on the tower's state and the patch bucket alone.
        self._vgraph: nnx.GraphDef | None = None
        # (base, the tower's state in it): splitting the tower out walks the whole model, so once per base state,
        # not once per row (the tower carries no LoRA: the snapshot stack does not change it).
        self._vstate: tuple[Any, Any] | None = None
        self.tower = AotCache("sample_tower", self._traced_tower)
        self.config = config
        self.graphdef = graphdef
        self.dtype = dtype
        self._zeros: dict[tuple[int, int], Any] = {}  # (rows, chunk): a text chunk's features, kept on the device
        # How admission and decode run a stacked model's layers (decoder_stack.py): a static setting of those
        # programs, so changing it builds (or finds) the other choice's programs and never reuses these.
        self.decode_layers: DecodeLayers = "scan"

    def caches(self) -> list[AotCache]:
        return [self.admit, self.decode, self.empty, self.tower]

    def row_images(self, lora, base, row: SampleRow, start: int, seen: dict | None = None) -> RowImages | None:
        """The row's images through the tower (one program per patch bucket), on a model that takes images; the
        row's prompt starts at `start` in the prefix cache; `seen`: features of one call's images by digest."""
        if not takes_images(self.config) or not row.images:
            return None

        def run(patches, vision):
            return self._tower(self._visual(lora, base), jnp.asarray(patches), jax.tree.map(jnp.asarray, vision))

        return row_images(self.config, row, run, start, seen)

    def _traced_tower(self, state: Any, patches: jax.Array, vision: Any) -> jax.Array:
        assert self._vgraph is not None, "_visual sets the tower's graph before its program is traced"
        return tower(self._vgraph, state, patches, vision)

    def _visual(self, lora, base) -> Any:
        """The tower's state in `base` (its graph kept for its programs)."""
        if self._vstate is None or self._vstate[0] is not base:
            self._vgraph, state = visual(self.graphdef, lora, base)
            self._vstate = (base, state)
        return self._vstate[1]

    def _tower(self, vstate, patches, vision, *, compile_only: bool = False) -> Any:
        label = f"patches={patches.shape[0]}"
        if compile_only:
            return self.tower.prepare(label, vstate, patches, vision)
        return self.tower(label, vstate, patches, vision)

    def warm_tower(self, lora, base) -> None:
        """Compile the tower at the smallest patch bucket (what a prompt's one small image takes), on a model that
        takes images; larger buckets compile when a prompt's images first reach them."""
        if not takes_images(self.config):
            return
        batch = blank_images(self.config)
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), batch)
        self._tower(self._visual(lora, base), shapes.patches, shapes.vision, compile_only=True)

    def admit_call(
        self,
        lora,
        base,
        bucket: SlotBucket,
        slots: Slots,
        pool: Any,
        rows: list[SampleRow],
        adm: Admission | None,
        chunk: Chunk,
        images: Sequence[RowImages | None] = (),
        *,
        compile_only: bool = False,
    ) -> tuple[Slots, Any, dict]:
        """One chunk of an admission: (the slots, the prefix cache's pool, the chunk's prompt scores) after it;
        `images`: the admitted rows' (`row_images`), on a model that takes them."""
        r = chunk.chunk.shape[0]
        chosen = [rows[i] for i in adm.chosen] if adm is not None else []
        params = self.placement.put_batch(admission.row_params(chosen, r))
        adapter = np.full((r,), -1, np.int32)
        scale = np.zeros((r,), np.float32)
        for i, row in enumerate(chosen):
            adapter[i], scale[i] = row.adapter, row.scale
        wants = np.array(adm.wants if adm is not None else (False,) * 3, bool)
        put = self.placement.put_batch
        label = f"{bucket.label} adapters={stack_size(lora)} rows={r} chunk={chunk.chunk.shape[1]}"
        c = chunk
        arrays = (c.chunk, c.nexts, c.start, c.prompt_len, c.index, c.final)
        args = (
            lora,
            base,
            slots,
            pool,
            *map(put, arrays),
            params,
            put(adapter),
            put(scale),
            put(c.cached),
            put(c.read),
            put(c.write),
            put(c.targets),
            jnp.asarray(wants),
            put(c.resume),
            put(c.snap),
            *self._images(chunk, list(images), bucket.slots),
        )
        scoring = bool(chunk.targets.shape[2])  # a scoring chunk has room for target ids
        label += " scoring" if scoring else ""
        if compile_only:
            self.admit.prepare(label, *args, scoring=scoring, decode_layers=self.decode_layers)
            return slots, pool, {}
        return self.admit(label, *args, scoring=scoring, decode_layers=self.decode_layers)

    def _images(self, chunk: Chunk, images: list[RowImages | None], slots: int) -> tuple[Any, Any]:
        """admit's `images` and `delta`: the chunk's (prompt_images.py), or None and None on a text-only model."""
        if not takes_images(self.config):
            return None, None
        fields, delta = chunk_images(chunk, images, feature_width(self.config), slots, self.dtype)
        put = self.placement.put_batch
        features = fields.pop("features")
        if features is None:
            r, c = chunk.chunk.shape
            if (r, c) not in self._zeros:
                self._zeros[(r, c)] = put(np.zeros((r, c, feature_width(self.config)), self.dtype))
            features = self._zeros[(r, c)]
        else:
            features = put(features)
        return PromptImages(features=features, **put(fields)), put(delta)

    def decode_call(
        self,
        lora,
        base,
        bucket: SlotBucket,
        slots: Slots,
        release: np.ndarray,
        steps: int,
        target: int,
        *,
        compile_only: bool = False,
    ) -> Slots:
        label = f"{bucket.label} adapters={stack_size(lora)}"
        args = (lora, base, slots, self.placement.put_batch(release), jnp.int32(steps), jnp.int32(target))
        if compile_only:
            self.decode.prepare(label, *args, decode_layers=self.decode_layers)
            return slots
        return self.decode(label, *args, decode_layers=self.decode_layers)
