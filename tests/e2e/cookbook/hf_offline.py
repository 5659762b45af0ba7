"""Hub data sets for recipes, offline: a small synthetic copy written into the local Hugging Face datasets cache, in
the layout `datasets.load_dataset(repo_id, config)` falls back to when the hub cannot be reached (HF_DATASETS_OFFLINE:
"Using the latest cached version of the dataset"). The recipes then run unmodified; the rows have the real data set's
columns, not its content. A user does the same with the real data: load it once online, or copy its cache
directory (`$HF_DATASETS_CACHE/<owner>___<name>/`) to the offline machine."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any


def cache_dataset(
    cache_dir: Path, repo_id: str, config: str | None, splits: dict[str, dict[str, list[Any]]], features: Any = None
) -> Path:
    """Write `splits` ({split: {column: values}}) as the cached `repo_id` / `config`; returns its directory.
    `features` (a `datasets.Features`) when a column's type cannot be inferred from its values (an Image, a
    ClassLabel); otherwise inferred."""
    import datasets
    from datasets.arrow_writer import ArrowWriter

    owner, name = repo_id.split("/")
    config_name = config or "default"
    directory = Path(cache_dir) / f"{owner}___{name}" / config_name / "0.0.0" / "synthetic"
    directory.mkdir(parents=True, exist_ok=True)
    infos = datasets.SplitDict(dataset_name=name)
    given = features
    for split, columns in splits.items():
        table = datasets.Dataset.from_dict(columns, features=given)
        features = table.features
        with ArrowWriter(features=table.features, path=str(directory / f"{name}-{split}.arrow")) as writer:
            writer.write_table(table.data.table)
            rows, _ = writer.finalize()
        infos.add(datasets.SplitInfo(name=split, num_examples=rows, dataset_name=name))
    info = datasets.DatasetInfo(
        features=features, config_name=config_name, dataset_name=name, builder_name=name, splits=infos, version="0.0.0"
    )
    info.write_to_directory(str(directory))
    return directory


def hub_cache(model: Path, cache: Path, hub_id: str) -> Path:
    """A Hugging Face hub cache holding `model`'s files but its weights under `hub_id`
    (models--<org>--<name>/snapshots/<revision>/, refs/main naming it): what a user's offline machine keeps after
    loading the tokenizer and image processor once. Returns `cache`."""
    revision = "0" * 40
    repo = Path(cache) / ("models--" + hub_id.replace("/", "--"))
    shutil.copytree(model, repo / "snapshots" / revision, ignore=shutil.ignore_patterns("*.safetensors"))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return Path(cache)
