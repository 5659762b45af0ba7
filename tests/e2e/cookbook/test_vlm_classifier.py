"""tinker-cookbook 0.6.1's `vlm_classifier` recipe, unmodified, through its CLI against a stack serving the tiny
Qwen3.5 vision-language model (`make-tiny-model --family qwen3_5 --vision`) under the recipe's own model name.

Offline as a user's machine would be: the stack gets an empty Hugging Face hub cache (the hub id is never looked up);
the client (the recipe) loads the tokenizer and image processor for the hub id from a client hub cache holding the
tiny model's non-weight files; `dpdl-benchmark/caltech101` is a small synthetic copy in the local datasets cache with
the real one's columns (`image` an Image, `label` a ClassLabel). Only sizes are overridden: `eval_every=2` runs both
of the recipe's evaluators at steps 0 and 2, each through a sampling client on prompts with images (the NLL one with
`compute_logprobs`, the classifier with `sample`).
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import API_KEY
from tests.e2e.cookbook.conftest import assert_steps_contiguous_from_zero, read_metrics, require_cookbook
from tests.e2e.cookbook.hf_offline import cache_dataset, hub_cache
from tests.e2e.cookbook.test_recipe_clis import run_recipe

require_cookbook()

# Two minutes on two cores: under -m slow. Images through the SDK stay in the default run (tests/e2e/test_images.py).
pytestmark = [pytest.mark.e2e, pytest.mark.slow]
HUB_ID = "Qwen/Qwen3.5-397B-A17B"  # vlm_classifier.train's default model_name
CLASSES = ["airplanes", "Faces_easy", "Motorbikes"]


@pytest.fixture(scope="module")
def vl_stack(tmp_path_factory) -> Iterator[tuple[object, Path]]:
    from tinkerflow.cli.launch import launch
    from tinkerflow.workers.engine.model.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("e2e-vlm-classifier")
    model = make_tiny_model(root / "tiny-qwen3_5-vl", family="qwen3_5", vision=True)
    empty_hub = root / "empty-hub"
    previous = os.environ.get("HF_HUB_CACHE")
    os.environ["HF_HUB_CACHE"] = str(empty_hub)  # the stack inherits it: the hub id is never looked up
    try:
        s = launch(
            root / "state",
            api_key=API_KEY,
            extra=["--base-model", str(model), "--served-model-name", HUB_ID, "--warm-up", "off"],
        )
    finally:
        if previous is None:
            os.environ.pop("HF_HUB_CACHE")
        else:
            os.environ["HF_HUB_CACHE"] = previous
    yield s, model
    s.stop()


def png(label: int, index: int) -> bytes:
    """A small PNG, a different colour per class (the rows need the real columns, not its content)."""
    from PIL import Image

    colour = (80 * label % 256, 40 + 60 * label % 216, 20 * index % 256)
    buffer = io.BytesIO()
    Image.new("RGB", (28 + 4 * index, 28), colour).save(buffer, format="PNG")
    return buffer.getvalue()


def cache_caltech101(cache: Path, rows_per_class: dict[str, int]) -> None:
    import datasets

    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=CLASSES)})
    splits = {
        split: {
            "image": [{"bytes": png(c, i), "path": None} for c in range(len(CLASSES)) for i in range(n)],
            "label": [c for c in range(len(CLASSES)) for _ in range(n)],
        }
        for split, n in rows_per_class.items()
    }
    cache_dataset(cache, "dpdl-benchmark/caltech101", None, splits, features=features)


@pytest.mark.timeout(1500)
def test_vlm_classifier_train_cli(vl_stack, tmp_path, monkeypatch):
    stack, model = vl_stack
    monkeypatch.setenv("TINKER_API_KEY", stack.api_key)
    monkeypatch.setenv("TINKER_BASE_URL", stack.base_url)
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache(model, tmp_path / "client-hub", HUB_ID)))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    cache_caltech101(tmp_path / "hf-datasets", {"train": 4, "test": 2})
    experiment_dir = tmp_path / "vlm_classifier"
    run_recipe(
        "tinker_cookbook.recipes.vlm_classifier.train",
        [
            f"experiment_dir={experiment_dir}",
            f"base_url={stack.base_url}",
            "batch_size=4",
            "num_epochs=1",
            "lora_rank=8",
            "max_steps=3",
            "eval_every=2",
            "save_every=0",
            "run_sampling_evaluator=True",
            "max_tokens=8",
            "n_eval=2",
            "behavior_if_log_dir_exists=delete",
        ],
        1400,
    )
    [log_path] = experiment_dir.iterdir()  # the recipe names its run directory itself
    rows = read_metrics(log_path)
    assert assert_steps_contiguous_from_zero(rows) == [0, 1, 2]
    losses = [r["train_mean_nll"] for r in rows if "train_mean_nll" in r]
    assert len(losses) == 3 and all(0 < x < float("inf") for x in losses), losses
    evaluated = {r["step"]: r for r in rows if "test/nll" in r}
    assert sorted(evaluated) == [0, 2], rows
    for row in evaluated.values():
        assert 0 < row["test/nll"] < float("inf"), row  # compute_logprobs on prompts with images
        assert 0 <= row["accuracy"] <= 1, row  # the classifier's answers, sampled from prompts with images
