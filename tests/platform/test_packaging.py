"""pyproject.toml's package list matches the tree, so an install ships every file and setuptools warns about none.

The packages are listed by hand because `tinkerflow.*` is mapped onto folders of other names (`package-dir`), which
setuptools' discovery cannot follow. Every folder under a mapped one is then a package to setuptools, data-only
folders included: one left out of `packages` is left out of a wheel, with a "Package ... would be ignored" warning
at every install; a data file no `package-data` pattern names is left out silently. A folder moved or added
(`workers/engine/<sub-package>/`) fails here, naming the line pyproject.toml needs.
"""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

from tests.conftest import REPO

SKIPPED = {"__pycache__"}


def _setuptools() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def _tree() -> dict[str, Path]:
    """Every package name the mapped folders hold (each folder and its sub-folders), with its folder."""
    found: dict[str, Path] = {}
    for package, folder in _setuptools()["package-dir"].items():
        root = REPO / folder
        for d in [root, *sorted(p for p in root.rglob("*") if p.is_dir())]:
            parts = d.relative_to(root).parts
            if any(p in SKIPPED or p.startswith(".") for p in parts):
                continue
            found[".".join((package, *parts))] = d
    return found


def test_every_folder_is_a_listed_package():
    listed = set(_setuptools()["packages"])
    tree = _tree()
    missing = sorted(set(tree) - listed)
    assert not missing, f"add to [tool.setuptools] packages in pyproject.toml: {missing}"
    gone = sorted(listed - set(tree))
    assert not gone, f"listed in pyproject.toml but no such folder: {gone}"


def test_every_data_file_is_package_data():
    patterns: dict[str, list[str]] = _setuptools().get("package-data", {})
    unnamed = []
    for package, folder in _tree().items():
        for f in sorted(p for p in folder.iterdir() if p.is_file()):
            if f.suffix in (".py", ".pyc") or f.name.endswith(".md"):
                continue  # modules ship as modules; a folder's README is for readers of the source
            if not any(fnmatch.fnmatch(f.name, pat) for pat in patterns.get(package, [])):
                unnamed.append(f"{package}: {f.relative_to(REPO)}")
    assert not unnamed, f"name these under [tool.setuptools.package-data] in pyproject.toml: {unnamed}"
