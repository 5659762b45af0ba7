"""The per-run metric point store: indices, idempotence, the bound, non-finite values, paging, two writers."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from tinkerflow.common.run_metrics import MetricPoint, RunMetricsStore, finite_or_none

RUN = "sess-1:train:0"


def _store(tmp_path, max_points: int = 100) -> RunMetricsStore:
    return RunMetricsStore((tmp_path / "store").as_uri(), max_points=max_points)


def test_points_get_increasing_indices_and_read_back_in_order(tmp_path):
    s = _store(tmp_path)
    for seq in range(1, 4):
        s.record(
            RUN,
            "forward_backward",
            f"seq:{2 * seq}",
            {"loss:sum": 1.0 / seq, "tokens": 8},
            seq_id=2 * seq,
            step=seq - 1,
        )
        s.record(
            RUN,
            "optim_step",
            f"seq:{2 * seq + 1}",
            {"grad_norm": 0.5, "learning_rate": 1e-4},
            seq_id=2 * seq + 1,
            step=seq - 1,
        )
    page = s.page(RUN)
    assert [p.index for p in page.points] == list(range(6))
    assert [p.op for p in page.points] == ["forward_backward", "optim_step"] * 3
    assert [p.seq_id for p in page.points] == [2, 3, 4, 5, 6, 7]
    assert page.points[2].metrics == {"loss:sum": 0.5, "tokens": 8.0}
    assert page.total_points == 6 and page.next_after is None


def test_a_retried_op_is_recorded_once(tmp_path):
    s = _store(tmp_path)
    assert s.record(RUN, "forward_backward", "seq:1", {"loss:sum": 2.0}, seq_id=1, step=0) is not None
    assert s.record(RUN, "forward_backward", "seq:1", {"loss:sum": 3.0}, seq_id=1, step=0) is None
    # A restarted worker (a fresh store object: nothing in memory) knows the key from the store.
    assert _store(tmp_path).record(RUN, "forward_backward", "seq:1", {"loss:sum": 3.0}, seq_id=1, step=0) is None
    (point,) = s.page(RUN).points
    assert point.metrics["loss:sum"] == 2.0


def test_non_finite_values_become_null(tmp_path):
    s = _store(tmp_path)
    s.record(
        RUN,
        "forward_backward",
        "seq:1",
        {"loss:sum": math.nan, "a": math.inf, "b": -math.inf, "c": "x"},
        seq_id=1,
        step=0,
    )
    (point,) = s.page(RUN).points
    assert point.metrics == {"loss:sum": None, "a": None, "b": None, "c": None}
    assert finite_or_none(1) == 1.0 and finite_or_none(None) is None


def test_the_bound_thins_old_points_of_every_kind_and_keeps_the_new(tmp_path):
    bound = 20
    s = _store(tmp_path, max_points=bound)
    for seq in range(1, 201):
        op = "forward_backward" if seq % 2 else "optim_step"
        s.record(RUN, op, f"seq:{seq}", {"loss:sum": float(seq)}, seq_id=seq, step=seq // 2)
        assert s.page(RUN, limit=5000).total_points <= bound
    points = s.page(RUN, limit=5000).points
    indices = [p.index for p in points]
    assert indices == sorted(indices) and indices[-1] == 199  # indices never change; the newest is kept
    assert indices[-4:] == [196, 197, 198, 199]  # recent points at full resolution
    older = points[: len(points) // 2]
    assert {p.op for p in older} == {"forward_backward", "optim_step"}  # thinning never empties a kind
    assert points[0].index == 0  # the first point stays: the curve still starts at the start


def test_two_writers_of_one_run_never_share_an_index(tmp_path):
    trainer, sampler = _store(tmp_path), _store(tmp_path)
    trainer.record(RUN, "forward_backward", "seq:1", {"loss:sum": 1.0}, seq_id=1, step=0)
    sampler.record(RUN, "sample", "sample:a", {"num_samples": 4, "tokens_generated": 32})
    trainer.record(RUN, "optim_step", "seq:2", {"grad_norm": 1.0}, seq_id=2, step=0)  # its cache says index 1: taken
    sampler.record(RUN, "sample", "sample:b", {"num_samples": 1})
    points = trainer.page(RUN).points
    assert [p.index for p in points] == [0, 1, 2, 3]
    assert sorted(p.op for p in points) == ["forward_backward", "optim_step", "sample", "sample"]
    assert points[-1].step == 0 and points[-1].seq_id is None  # a sample takes the run's latest known step


def test_runs_are_separate_and_an_unknown_run_is_empty(tmp_path):
    s = _store(tmp_path)
    s.record(RUN, "forward_backward", "seq:1", {"loss:sum": 1.0}, seq_id=1, step=0)
    s.record("other:train:0", "forward_backward", "seq:1", {"loss:sum": 9.0}, seq_id=1, step=0)
    assert [p.metrics["loss:sum"] for p in s.page(RUN).points] == [1.0]
    empty = s.page("nobody:train:0")
    assert empty.points == [] and empty.total_points == 0 and empty.next_after is None


@settings(max_examples=25, deadline=None)
@given(n=st.integers(0, 30), limit=st.integers(1, 7), after=st.integers(-1, 35))
def test_paging_visits_every_point_once(tmp_path_factory, n, limit, after):
    s = _store(tmp_path_factory.mktemp("paging"))
    for seq in range(n):
        s.record(RUN, "forward", f"seq:{seq}", {"loss:sum": float(seq)}, seq_id=seq, step=0)
    seen: list[MetricPoint] = []
    cursor: int | None = after
    while cursor is not None:
        page = s.page(RUN, after=cursor, limit=limit)
        assert len(page.points) <= limit and page.total_points == n
        seen += page.points
        cursor = page.next_after
    assert [p.index for p in seen] == list(range(max(after + 1, 0), n))
