"""yamllint over every YAML file under infra/ (config: infra/.yamllint.yaml)."""

from __future__ import annotations

import pytest

from tests.infra.conftest import INFRA

yamllint_config = pytest.importorskip("yamllint.config", reason="yamllint is not installed (pip install yamllint)")
from yamllint import linter  # noqa: E402


def test_yaml_is_tidy():
    conf = yamllint_config.YamlLintConfig(file=str(INFRA / ".yamllint.yaml"))
    problems = []
    for path in sorted(INFRA.rglob("*.yaml")):
        for p in linter.run(path.read_text(), conf, str(path)):
            if p.level == "error":
                problems.append(f"{path.relative_to(INFRA)}:{p.line}:{p.column} {p.desc} ({p.rule})")
    assert not problems, "\n".join(problems)
