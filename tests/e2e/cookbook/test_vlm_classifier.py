"""tinker-cookbook 0.6.1's `vlm_classifier` recipe, unmodified, against the tiny Qwen3.5 vision-language model
(`make-tiny-model --family qwen3_5 --vision`) served as `Qwen/Qwen3.5-4B`: its renderer (`qwen3_5_disable_thinking`)
cuts each photo with the model's image processor into an `ImageChunk`, and the service trains on them.

The data set is a synthetic caltech101 in the local datasets cache (tests/e2e/cookbook/hf_offline.py): the real
one's columns, `image` (an Image feature, small PNGs) and `label` (a ClassLabel). The client reads the tokenizer and
image processor of the hub id from its own offline HF cache, as a user's machine that once loaded the model would.
Both of the recipe's evaluators score through the sampling client (`compute_logprobs`, `sample`), which does not
take images yet, so they are off (`eval_every=0`, `run_sampling_evaluator=False`); EVALUATE turns them on.
"""

from __future__ import annotations

import io
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.e2e.conftest import API_KEY, QWEN3_5_HUB_ID
from tests.e2e.cookbook.conftest import assert_steps_contiguous_from_zero, read_metrics, require_cookbook
from tests.e2e.cookbook.hf_offline import cache_dataset
from tests.e2e.cookbook.test_recipe_clis import run_recipe
from tinkerflow.cli.launch import RunningStack, launch

require_cookbook()
pytestmark = pytest.mark.e2e

CLASSES = ["airplanes", "Faces_easy", "watch"]
EVALUATE = False  # True once sampling takes images: the NLL and sampling evaluators at steps 0 and 2
REVISION = "1" * 40  # the snapshot refs/main names in the client's cache


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory) -> Path:
    from tinkerflow.workers.engine.model.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("tiny-qwen3_5-vl")
    return make_tiny_model(root / "model", family="qwen3_5", vision=True, progress=False)


@pytest.fixture(scope="module")
def vl_stack(tmp_path_factory, vl_model) -> Iterator[RunningStack]:
    root = tmp_path_factory.mktemp("e2e-vlm")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_HUB_CACHE", str(root / "empty-hub"))  # the stack's own cache: nothing to fetch from
        s = launch(
            root / "state",
            api_key=API_KEY,
            extra=["--base-model", str(vl_model), "--served-model-name", QWEN3_5_HUB_ID, "--warm-up", "off"],
        )
    yield s
    s.stop()


def _client_hub_cache(root: Path, model: Path) -> Path:
    """A Hugging Face hub cache holding `model`'s files but its weights under QWEN3_5_HUB_ID."""
    repo = root / ("models--" + QWEN3_5_HUB_ID.replace("/", "--"))
    shutil.copytree(model, repo / "snapshots" / REVISION, ignore=shutil.ignore_patterns("*.safetensors"))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return root


def _png(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    height, width = (int(x) for x in rng.integers(40, 90, 2))
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), np.uint8)).save(out, format="PNG")
    return out.getvalue()


def _caltech101(cache: Path) -> None:
    import datasets

    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=CLASSES)})

    def split(seed: int, n: int) -> dict[str, list]:
        return {
            "image": [{"bytes": _png(seed + i), "path": None} for i in range(n)],
            "label": [i % len(CLASSES) for i in range(n)],
        }

    cache_dataset(cache, "dpdl-benchmark/caltech101", None, {"train": split(0, 6), "test": split(100, 3)}, features)


@pytest.mark.timeout(1500)
def test_vlm_classifier_trains_on_images_to_step_2(vl_stack, vl_model, tmp_path, monkeypatch):
    monkeypatch.setenv("TINKER_API_KEY", vl_stack.api_key)
    monkeypatch.setenv("TINKER_BASE_URL", vl_stack.base_url)
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(_client_hub_cache(tmp_path / "client-hub", vl_model)))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    _caltech101(tmp_path / "hf-datasets")
    experiments = tmp_path / "experiments"
    run_recipe(
        "tinker_cookbook.recipes.vlm_classifier.train",
        [
            f"experiment_dir={experiments}",
            f"base_url={vl_stack.base_url}",
            f"model_name={QWEN3_5_HUB_ID}",
            "batch_size=2",
            "lora_rank=8",
            "max_steps=3",
            f"eval_every={2 if EVALUATE else 0}",
            "save_every=0",
            f"run_sampling_evaluator={EVALUATE}",
            "behavior_if_log_dir_exists=delete",
        ],
        1400,
    )
    (log_path,) = experiments.iterdir()  # the recipe names its run directory itself
    rows = read_metrics(log_path)
    assert assert_steps_contiguous_from_zero(rows) == [0, 1, 2]
    losses = [r["train_mean_nll"] for r in rows if "train_mean_nll" in r]
    assert len(losses) == 3 and all(np.isfinite(losses)), losses
    evaluated = sorted(r["step"] for r in rows if any(k.startswith("test/") for k in r))
    assert evaluated == ([0, 2] if EVALUATE else []), rows
