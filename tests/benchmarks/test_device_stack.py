"""`python -m benchmarks.device_stack --smoke`: the whole stack (tinkerflow up, the tinker SDK) and the engine alone
run the same workload on the tiny model on CPU, and each figure carries both sides and their ratio; with `--shape
tiny` the stack serves a config-only directory with random weights, as the GPU run serves Qwen3-8B, and the
cookbook's math_rl recipe reports its step times. Marked slow: it starts a Temporal dev server and every part of
the stack (about 3 minutes here, more on a loaded CI machine)."""

from __future__ import annotations

import json

import pytest

from benchmarks import device_stack


@pytest.mark.slow
def test_the_stack_and_the_engine_alone_report_the_same_workload(capsys):
    assert device_stack.main(["--smoke", "--concurrency", "4", "--shape", "tiny"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    figures = {x["figure"]: x for x in lines if x.get("phase") == "stack"}
    assert set(figures) == {"forward_backward_tokens_per_s", "sample_tokens_per_s", "math_rl_step_s"}
    assert {x["weights"] for x in figures.values()} == {"random"}
    rl = figures.pop("math_rl_step_s")
    assert rl["status"] == 0, rl["output_tail"]
    assert rl["steps"] == 3 and len(rl["step_s"]) == 3
    assert rl["first_step_s"] > 0 and rl["warm_step_s"] > 0
    for figure in figures.values():
        assert figure["service"] > 0 and figure["engine"] > 0 and figure["service_over_engine"] > 0
        assert {"device", "jax", "commit", "utc"} <= figure.keys()
    sample = figures["sample_tokens_per_s"]
    # stop=[]: neither side stops early, so each round produced concurrency x max_tokens tokens on both sides
    wanted = 4 * sample["workload"]["max_tokens"]
    assert [n for _, n in sample["service_runs_s"]] == [wanted] * 2
    assert [n for _, n in sample["engine_runs_s"]] == [wanted] * 2
