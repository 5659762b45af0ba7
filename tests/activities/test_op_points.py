"""Which run an engine answer's metric point belongs to (activities/op_points.py), and what records nothing."""

from __future__ import annotations

from tinkerflow.activities.op_points import OpPoints
from tinkerflow.common.run_metrics import RunMetricsStore
from tinkerflow.workflows.protocol.messages import WorkItem, WorkKind

RUN = "s1:train:0"


def _points(tmp_path) -> OpPoints:
    return OpPoints(RunMetricsStore((tmp_path / "store").as_uri()))


def _ops(points: OpPoints, run: str = RUN) -> list[tuple[str, int | None, int]]:
    return [(p.op, p.seq_id, p.step) for p in points.store.page(run).points]


def test_training_items_record_under_their_seq_id_and_replays_record_nothing(tmp_path):
    points = _points(tmp_path)
    item = WorkItem(
        key="r-1", requester="training-run/x", kind=WorkKind.FORWARD_BACKWARD, model_id=RUN, seq_id=3, step=1
    )
    points.training(item, "forward_backward", {"loss:sum": 1.5})
    points.training(item, "forward_backward", {"loss:sum": 1.5})  # the same op answered again
    replay = WorkItem(key="r-2", requester="training-run/x", kind=WorkKind.FORWARD_BACKWARD, model_id=RUN)
    points.training(replay, "forward_backward", {"loss:sum": 9.0})  # a recovery replaying logged ops: no seq_id
    assert _ops(points) == [("forward_backward", 3, 1)]


def test_sample_calls_count_against_the_run_whose_weights_they_sampled(tmp_path):
    points = _points(tmp_path)
    snapshot = WorkItem(key="r-3", requester="x", kind=WorkKind.SNAPSHOT, model_id=RUN, snapshot="s1:sample:0")
    points.snapshot_taken(snapshot)

    def sample(key: str, weights: str) -> WorkItem:
        return WorkItem(key=key, requester="sample/x", kind=WorkKind.SAMPLE, snapshot=weights)

    points.sample(sample("a", "s1:sample:0"), {"num_samples": 2})  # ephemeral weights this worker took
    points.sample(sample("b", f"tinker://{RUN}/sampler_weights/final"), {"num_samples": 1})  # saved weights
    points.sample(sample("c", ""), {"num_samples": 4})  # the base model: no run
    points.snapshots_dropped(["s1:sample:0"])
    points.sample(sample("d", "s1:sample:0"), {"num_samples": 8})  # dropped: no longer known
    assert [p.metrics["num_samples"] for p in points.store.page(RUN).points] == [2.0, 1.0]
    assert points.run_of_snapshot("tinker://not a path") == ""
