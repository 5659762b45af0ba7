"""The store janitor's sweep (`sweep_claim_checks`) collects everything the store keeps per request on one
retention: bodies and results, and also the nested futures records `asample` writes for `retrieve_futures`, the
markers of `cancel_future` and the stability records of `record_stability_info` calls; on a local disk the folders
those leave empty go too. On a local directory and on GCS
(gcp-storage-emulator on loopback)."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any, cast

import pytest

from tinkerflow.activities.storage_activities import StorageActivities
from tinkerflow.api import session_futures
from tinkerflow.common import stability_records
from tinkerflow.common.checkpoints import CheckpointStore
from tinkerflow.common.store import ClaimCheckStore, write_whole

SAMPLER = "sess-1:sample:0"
WEIGHTS = stability_records.Weights(SAMPLER, "tiny")


def _svc(store: ClaimCheckStore) -> Any:
    return cast(Any, SimpleNamespace(store=store))  # session_futures reads only the store of its Services


def _write(store: ClaimCheckStore, path: str, data: bytes) -> None:
    store.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    write_whole(store.fs, path, data)


@pytest.mark.parametrize("where", ["file", "gs"])
def test_the_sweep_collects_old_futures_records_cancel_markers_and_stability_records(where, tmp_path, request):
    root = (tmp_path / "store").as_uri() if where == "file" else f"{request.getfixturevalue('gcs')}/nested"
    store = ClaimCheckStore(root)
    svc = _svc(store)
    # Old: a clone's futures record (two folders deep), another sampler's whose folders hold nothing else, a cancel
    # marker, a stability record.
    session_futures.record(svc, SAMPLER, 7, "req-old", "body-uri-old")
    session_futures.record(svc, "sess-2:sample:3", 1_000_000_001, "req-gone", "body-uri-gone")
    _write(store, store.cancel_marker("body-uri-old"), b"req-old")
    stability_records.write_call(
        store, stability_records.CallRecord("sample/old#0", "body-uri-old", "o", "sess-1", WEIGHTS)
    )
    old = session_futures._records(svc, session_futures._dir(svc, SAMPLER, 0))
    assert [r["request_id"] for r in old.values()] == ["req-old"]
    time.sleep(1.5)
    # New: the same clone's next record, a new marker and stability record.
    session_futures.record(svc, SAMPLER, 8, "req-new", "body-uri-new")
    _write(store, store.cancel_marker("body-uri-new"), b"req-new")
    stability_records.write_call(
        store, stability_records.CallRecord("sample/new#0", "body-uri-new", "o", "sess-1", WEIGHTS)
    )
    fresh = store.put(b"a body", "requests")

    swept = StorageActivities(CheckpointStore((tmp_path / "c").as_uri()), store, retention_s=1.0).sweep_claim_checks()
    assert swept["objects"] == 4, swept
    left = session_futures._records(svc, session_futures._dir(svc, SAMPLER, 0))
    assert [r["request_id"] for r in left.values()] == ["req-new"]
    assert session_futures.find_payload(svc, SAMPLER, "req-new") == "body-uri-new"
    assert session_futures.find_payload(svc, SAMPLER, "req-old") is None
    assert session_futures.find_payload(svc, "sess-2:sample:3", "req-gone") is None
    assert not store.fs.exists(store.cancel_marker("body-uri-old"))
    assert store.fs.exists(store.cancel_marker("body-uri-new"))
    assert store.get(fresh) == b"a body"
    assert len(store.fs.ls(f"{store.root}/{stability_records.KIND}")) == 1  # the new call's record
    if where == "file":  # the emptied sampler's folders went with their record; the kinds' own folders stay
        assert not (tmp_path / "store" / "futures" / "sess-2%3Asample%3A3").exists()
        assert (tmp_path / "store" / "futures" / "sess-1%3Asample%3A0" / "0").is_dir()
        assert (tmp_path / "store" / "cancelled").is_dir()
    # A retention of 0 keeps everything.
    assert StorageActivities(CheckpointStore((tmp_path / "c").as_uri()), store).sweep_claim_checks()["objects"] == 0


def test_a_futures_record_is_written_even_when_the_janitor_takes_its_empty_folder_meanwhile(tmp_path, monkeypatch):
    """The janitor removes an old empty folder between asample's makedirs and its write: the write tries again."""
    store = ClaimCheckStore((tmp_path / "store").as_uri())
    svc = _svc(store)
    writes: list[str] = []
    real = session_futures.write_whole

    def folder_gone_once(fs, path: str, data: bytes) -> None:
        writes.append(path)
        if len(writes) == 1:
            fs.rm(path.rsplit("/", 1)[0], recursive=True)
            raise FileNotFoundError(path)
        real(fs, path, data)

    monkeypatch.setattr(session_futures, "write_whole", folder_gone_once)
    session_futures.record(svc, SAMPLER, 5, "req-5", "body-5")
    assert len(writes) == 2 and session_futures.find_payload(svc, SAMPLER, "req-5") == "body-5"
