"""harbor_rl's launcher (as its scripts/train_terminal_bench.py) with the tasks of a local directory and
LocalDirectorySandbox for Modal: `python -m tests.e2e.cookbook.harbor_local <tasks dir> key=value ...`."""

from __future__ import annotations

import asyncio
import sys

import chz
from tinker_cookbook.recipes.harbor_rl.harbor_env import load_harbor_tasks
from tinker_cookbook.recipes.harbor_rl.train import CLIConfig, cli_main

from tests.e2e.cookbook.local_sandbox import local_sandbox_factory

if __name__ == "__main__":
    tasks = load_harbor_tasks(sys.argv[1])  # an absolute path replaces the Harbor cache directory
    cli_config = chz.entrypoint(CLIConfig, argv=sys.argv[2:])
    asyncio.run(cli_main(cli_config, tasks, sandbox_factory=local_sandbox_factory))
