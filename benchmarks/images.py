"""Images: how many images per second the Qwen3.5 vision tower takes, and what an image prompt costs against a text
prompt of the same token count, on the tiny vision-language model (`make-tiny-model --family qwen3_5 --vision`).

    python -m benchmarks.images [--sizes 64,128,256] [--images 4] [--repeats 5] [--skip-sdk] [--smoke]

Each image is a square PNG of noise of `size` pixels a side, cut by the model's own image processor (its token
count follows from the processor's patch and merge sizes). Figures, one JSON line each, with the load average
(os.getloadavg) before and after:

* `images_tower_images_per_s` (pixels, images, tokens): `--images` images through the tower alone (the engine's
  `visual`, jitted on its own), warm (median of `--repeats`); `compile_s`, the first call, beside.
  The tiny model's processor caps an image at 64 tokens (its max_pixels), so sizes past 256 add nothing here.
* `images_forward_backward_ms` (pixels, tokens): forward_backward of one datum, 4 text tokens, the image's
  placeholders, 4 text tokens; tinkerflow = through the unmodified SDK against `tinkerflow up` (launched here, warm-up
  off), engine = Engine.forward_backward alone in this process; warm medians. `text_*` is the same for a text-only
  datum of the same token count, `image_over_text_*` the ratio (the tower's and the image batch's cost), `first_ms`
  the first call of each (its compile). The engine's image calls include cutting the PNG, as the JAX worker's do.
* `images_sample_ms` (pixels, tokens): one sample call of a prompt of the same layout, SAMPLE_TOKENS generated and
  never stopping early, through the SDK's sampling client and Engine.sample alone, beside its text twin, as above.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")

import numpy as np

from benchmarks.common import emit, emit_pair, running_stack, served_model, share_compile_cache

API_KEY = "tml-bench-images"
TEXT = [5, 17, 42, 99, 3, 250, 7, 11]  # the 4 tokens before the image and the 4 after
SAMPLE_TOKENS = 8  # tokens a sample figure's call generates (it never stops early: stop=[])


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def png(size: int, seed: int) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size, 3), np.uint8)).save(out, "PNG")
    return out.getvalue()


def first_and_warm_ms(call: Callable[[int], object], repeats: int) -> tuple[float, float]:
    """The first call (its compile included) and the median of `repeats` more, each on its own seed."""
    times = []
    for seed in range(repeats + 1):
        t0 = time.perf_counter()
        call(seed)
        times.append((time.perf_counter() - t0) * 1000)
    return times[0], statistics.median(times[1:])


class EngineImages:
    """The tiny VL model in this process: its processor, the tower alone, and the engine's forward_backward."""

    def __init__(self, model: Path) -> None:
        from tinkerflow.common.images import ImageProcessing, model_image_processor
        from tinkerflow.workers.engine.engine import Engine
        from tinkerflow.workers.engine.types import LoraConfig

        self.processing = ImageProcessing.from_hf(model_image_processor(model) or {})
        self.engine = Engine.load(str(model), max_lora_adapters=2, max_lora_rank=8, progress=False)
        self.engine.create_adapter(0, LoraConfig(rank=8, seed=0))
        image_id = self.engine.info.image_token_id
        assert image_id is not None, f"{model} has no vision tower"
        self.image_id = image_id

    def image(self, size: int, seed: int):
        from tinkerflow.common.images import decode_image, preprocess

        return preprocess(decode_image(png(size, seed), "png"), self.processing)

    def tower(self, size: int, count: int, repeats: int) -> tuple[float, float, int]:
        """(first_ms, warm_ms, tokens per image) of `count` images of `size` through the tower alone."""
        import jax
        from flax import nnx

        from tinkerflow.workers.engine.model.families.qwen3_5.vision_batch import image_batch

        engine = self.engine
        model = nnx.merge(engine._graphdef, engine.adapters.lora, engine.base)
        graphdef, state = nnx.split(model.visual)
        run = jax.jit(lambda state, patches, vision: nnx.merge(graphdef, state)(patches, vision)[0])
        start, end = self.image_id - 2, self.image_id - 1  # <|vision_start|>, <|vision_end|>

        batches = []  # cut before the clock starts: the figure is the tower's alone
        for seed in range(repeats + 1):
            images = [self.image(size, 1000 * seed + i) for i in range(count)]
            tokens = np.concatenate([[start] + [self.image_id] * im.tokens + [end] for im in images])[None]
            batches.append(image_batch(engine.config, tokens.astype(np.int32), np.ones_like(tokens, np.int32), images))

        def call(seed: int):
            return jax.block_until_ready(run(state, batches[seed].patches, batches[seed].vision))

        first, warm = first_and_warm_ms(call, repeats)
        return first, warm, self.image(size, 0).tokens

    def forward_backward(self, size: int, repeats: int, with_image: bool) -> tuple[float, float]:
        from tinkerflow.workers.engine.types import Datum, ForwardBackwardInput

        n = self.image(size, 0).tokens

        def call(seed: int):
            if with_image:
                image = self.image(size, seed)
                tokens, images = TEXT[:4] + [self.image_id] * n + TEXT[4:], (image,)
            else:
                tokens, images = np.random.default_rng(seed).integers(1, 1800, n + len(TEXT)).tolist(), ()
            inputs = {"target_tokens": np.ones(len(tokens), np.int64), "weights": np.ones(len(tokens), np.float32)}
            datum = Datum(np.asarray(tokens, np.int32), inputs, images=images)
            [out] = self.engine.forward_backward([ForwardBackwardInput(slot=0, data=[datum], loss_fn="cross_entropy")])
            assert not isinstance(out, Exception), out

        return first_and_warm_ms(call, repeats)

    def sample(self, size: int, repeats: int, with_image: bool) -> tuple[float, float]:
        """A prompt of the same layout (the image, or as many text tokens), SAMPLE_TOKENS sampled, never stopping."""
        from tinkerflow.workers.engine.types import SampleInput, SampleResult

        n = self.image(size, 0).tokens

        def call(seed: int):
            if with_image:
                tokens, images = TEXT[:4] + [self.image_id] * n + TEXT[4:], (self.image(size, seed),)
            else:
                tokens, images = np.random.default_rng(seed).integers(1, 1800, n + len(TEXT)).tolist(), ()
            prompt = np.asarray(tokens, np.int32)
            request = SampleInput(prompt, max_tokens=SAMPLE_TOKENS, seed=seed, stop_token_ids=[], images=images)
            [out] = self.engine.sample([request])
            assert isinstance(out, SampleResult), out

        return first_and_warm_ms(call, repeats)


def sdk_chunks(size: int, tokens: int, with_image: bool, seed: int) -> list:
    """The SDK's chunks of the engine's layouts: 4 text tokens, the image, 4 text tokens; or as many text tokens."""
    from tinker import types

    if not with_image:
        return [
            types.EncodedTextChunk(tokens=np.random.default_rng(seed).integers(1, 1800, tokens + len(TEXT)).tolist())
        ]
    return [
        types.EncodedTextChunk(tokens=TEXT[:4]),
        types.ImageChunk(data=png(size, seed), format="png", expected_tokens=tokens),
        types.EncodedTextChunk(tokens=TEXT[4:]),
    ]


def sdk_sample(base_url: str, size: int, tokens: int, repeats: int) -> dict[bool, tuple[float, float]]:
    """{with_image: (first_ms, warm_ms)} of one sample call through the SDK, the engine's prompts and lengths."""
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=base_url, api_key=API_KEY)
    sampler = service.create_sampling_client(base_model=served_model(base_url, API_KEY))

    def call(with_image: bool, seed: int):
        prompt = types.ModelInput(chunks=sdk_chunks(size, tokens, with_image, seed))  # pyright: ignore[reportArgumentType]
        params = types.SamplingParams(max_tokens=SAMPLE_TOKENS, seed=seed, stop=[])
        sampler.sample(prompt, 1, params).result()

    return {w: first_and_warm_ms(lambda seed, w=w: call(w, seed), repeats) for w in (True, False)}


def sdk_forward_backward(base_url: str, size: int, tokens: int, repeats: int) -> dict[bool, tuple[float, float]]:
    """{with_image: (first_ms, warm_ms)} of forward_backward through the SDK, the same datums as the engine's."""
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=base_url, api_key=API_KEY)
    training = service.create_lora_training_client(base_model=served_model(base_url, API_KEY), rank=8).result()

    def call(with_image: bool, seed: int):
        chunks = sdk_chunks(size, tokens, with_image, seed)
        n = tokens + len(TEXT)
        datum = types.Datum(
            model_input=types.ModelInput(chunks=chunks),  # pyright: ignore[reportArgumentType] (a list of chunks)
            loss_fn_inputs={
                "target_tokens": types.TensorData.from_numpy(np.ones(n, np.int64)),
                "weights": types.TensorData.from_numpy(np.ones(n, np.float32)),
            },
        )
        training.forward_backward([datum], "cross_entropy").result()

    return {w: first_and_warm_ms(lambda seed, w=w: call(w, seed), repeats) for w in (True, False)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="64,128,256", help="square image sides in pixels, comma-separated")
    p.add_argument("--images", type=int, default=4, help="images per tower call")
    p.add_argument("--repeats", type=int, default=5, help="warm calls per figure (after the first)")
    p.add_argument("--skip-sdk", action="store_true", help="the engine alone (no stack)")
    p.add_argument("--smoke", action="store_true", help="one 64-pixel size, 2 images, 1 repeat, engine alone")
    args = p.parse_args()
    if args.smoke:
        args.sizes, args.images, args.repeats, args.skip_sdk = "64", 2, 1, True
    sizes = [int(s) for s in args.sizes.split(",")]

    from tinkerflow.workers.engine.model.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="tinkerflow-bench-images-") as d:
        model = make_tiny_model(Path(d) / "tiny-qwen3_5-vl", family="qwen3_5", vision=True)
        extra = ["--base-model", str(model), "--max-lora-adapters", "2", "--warm-up", "off"]
        stack_or_none = contextlib.nullcontext((None, None)) if args.skip_sdk else running_stack(None, API_KEY, extra)
        with stack_or_none as (base_url, stack):
            share_compile_cache(stack)
            engine = EngineImages(model)
            for size in sizes:
                before = load()
                first, warm, tokens = engine.tower(size, args.images, args.repeats)
                emit(
                    figure="images_tower_images_per_s",
                    unit="images/s",
                    engine=round(args.images / (warm / 1000), 3),
                    pixels=size,
                    images=args.images,
                    tokens=tokens,
                    compile_s=round(first / 1000, 3),
                    load_before=before,
                    load_after=load(),
                )
            for figure, ours_of, theirs_of in (
                ("images_forward_backward_ms", engine.forward_backward, sdk_forward_backward),
                ("images_sample_ms", engine.sample, sdk_sample),
            ):
                for size in sizes:
                    before = load()
                    tokens = engine.image(size, 0).tokens
                    ours = {w: ours_of(size, args.repeats, w) for w in (True, False)}
                    theirs = theirs_of(base_url, size, tokens, args.repeats) if base_url else None
                    emit_figure(figure, size, tokens, ours, theirs, before)
                    print(f"images: {figure} {size} px ({tokens} tokens) done", file=sys.stderr, flush=True)


def emit_figure(figure: str, size: int, tokens: int, ours: dict, theirs: dict | None, before: list[float]) -> None:
    """One image-against-text figure: warm image ms through the service beside the engine alone, with the text twin's
    and the first calls' beside it (`ours`, `theirs`: {with_image: (first_ms, warm_ms)})."""
    fields = {
        "pixels": size,
        "tokens": tokens,
        "engine_first_ms": round(ours[True][0], 3),
        "text_engine_ms": round(ours[False][1], 3),
        "text_engine_first_ms": round(ours[False][0], 3),
        "image_over_text_engine": round(ours[True][1] / ours[False][1], 3),
    }
    if theirs is None:
        emit(figure=figure, unit="ms", engine=round(ours[True][1], 3), **fields, load_before=before, load_after=load())
        return
    fields |= {
        "tinkerflow_first_ms": round(theirs[True][0], 3),
        "text_tinkerflow_ms": round(theirs[False][1], 3),
        "image_over_text_tinkerflow": round(theirs[True][1] / theirs[False][1], 3),
    }
    emit_pair(figure, "ms", theirs[True][1], ours[True][1], **fields, load_before=before, load_after=load())


if __name__ == "__main__":
    main()
