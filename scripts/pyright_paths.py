"""Build the `tinkerflow.*` import tree pyright reads: build/pyright/tinkerflow/<pkg> -> the source folder.

`pip install -e .` maps `tinkerflow.api` to platform/api (pyproject's `[tool.setuptools.package-dir]`) with an
import hook, which static checkers cannot follow. This script reads the same mapping and links each package folder
into an ignored tree that `[tool.pyright] extraPaths` names, so pyright resolves `tinkerflow.*` to the very files
the interpreter imports. Run by scripts/lint.sh (and scripts/setup.sh, for editors); safe to run again.
"""

from __future__ import annotations

import os
import shutil
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TREE = REPO / "build" / "pyright"


def main() -> None:
    package_dir: dict[str, str] = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ]
    shutil.rmtree(TREE, ignore_errors=True)
    for package, folder in package_dir.items():
        link = TREE.joinpath(*package.split("."))
        link.parent.mkdir(parents=True, exist_ok=True)
        # Relative links: the tree stays valid if the checkout moves.
        link.symlink_to(os.path.relpath(REPO / folder, link.parent))
        if not link.is_dir():
            raise SystemExit(f"pyright_paths: {package} -> {folder} is not a folder")


if __name__ == "__main__":
    main()
