"""Checkpoint storage on a local directory and on GCS (gcp-storage-emulator on loopback, through gcsfs), the
expiry activity, the claim-check store on GCS, and the signed download URLs."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest

from tinkerflow.activities.storage_activities import StorageActivities
from tinkerflow.api import signed_urls
from tinkerflow.common.checkpoints import (
    CheckpointError,
    CheckpointNotFound,
    CheckpointStore,
    Manifest,
    TinkerPath,
    check_ttl,
    expiry_after,
    now_rfc3339,
)
from tinkerflow.common.store import ClaimCheckStore

RUN = "sess-abc:train:0"


@pytest.fixture(params=["file", "gs"])
def root(request, tmp_path) -> str:
    if request.param == "file":
        return (tmp_path / "checkpoints").as_uri()
    return f"{request.getfixturevalue('gcs')}/ckpt-{time.monotonic_ns()}"


def manifest(path: str, owner: str = "alice", **changes) -> Manifest:
    m = Manifest(
        tinker_path=path,
        owner=owner,
        base_model="tiny",
        time=now_rfc3339(),
        lora={"rank": 4, "seed": None, "train_attn": True, "train_mlp": True, "train_unembed": True},
    )
    return replace(m, **changes)


def payload(tmp_path: Path, text: str = "weights") -> Path:
    d = tmp_path / f"payload-{time.monotonic_ns()}"
    (d / "state").mkdir(parents=True)
    (d / "state" / "w.bin").write_text(text)
    (d / "adapter_config.json").write_text("{}")
    return d


@pytest.mark.parametrize(
    "path, message",
    [
        ("tinker://x", "malformed"),
        ("s3://run/weights/a", "not a tinker:// path"),
        ("tinker://run/weights/a/b", "malformed"),
        ("tinker://run/secrets/a", "unknown checkpoint kind"),
        ("tinker://run/weights/..", "must be non-empty"),
        ("tinker://../weights/a", "malformed"),
    ],
)
def test_malformed_paths_are_refused_with_what_to_do(path, message):
    with pytest.raises(CheckpointError, match=message):
        TinkerPath.parse(path)


def test_paths_round_trip_and_ttls_are_bounded():
    p = TinkerPath.parse(f"tinker://{RUN}/sampler_weights/step-10")
    assert (p.run, p.checkpoint_id, p.checkpoint_type, str(p)) == (
        RUN,
        "sampler_weights/step-10",
        "sampler",
        f"tinker://{RUN}/sampler_weights/step-10",
    )
    assert TinkerPath.from_checkpoint_id(RUN, "weights/a") == TinkerPath(RUN, "weights", "a")
    check_ttl(None)
    check_ttl(3600)
    for bad in (5, 11 * 365 * 24 * 3600):
        with pytest.raises(CheckpointError, match="ttl_seconds"):
            check_ttl(bad)


def test_commit_list_read_update_delete(root, tmp_path):
    store = CheckpointStore(root)
    path = f"tinker://{RUN}/weights/a"
    committed = store.commit(manifest(path), payload(tmp_path), overwrite=False)
    assert committed.files == {"adapter_config.json": 2, "state/w.bin": 7} and committed.size_bytes == 9
    assert [m.tinker_path for m in store.list(RUN)] == [path] == [m.tinker_path for m in store.list()]
    with pytest.raises(CheckpointError, match="already exists"):
        store.commit(manifest(path), payload(tmp_path), overwrite=False)
    store.commit(manifest(path), payload(tmp_path, "new weights"), overwrite=True)
    out = tmp_path / "out"
    store.download(TinkerPath.parse(path), out)
    assert (out / "state" / "w.bin").read_text() == "new weights"

    assert store.readable(path, "alice").owner == "alice"
    with pytest.raises(CheckpointNotFound, match="not yours"):
        store.readable(path, "bob")
    store.update(TinkerPath.parse(path), public=True)
    assert store.readable(path, "bob").public
    assert store.list(RUN)[0].as_checkpoint()["public"] is True

    assert store.delete(TinkerPath.parse(path))
    assert store.list(RUN) == [] and not store.fs.exists(store.dir_of(TinkerPath.parse(path)))
    with pytest.raises(CheckpointNotFound):
        store.readable(path, "alice")


def test_an_uncommitted_save_never_lists_or_loads_and_the_next_save_sweeps_it(root, tmp_path):
    store = CheckpointStore(root)
    p = TinkerPath.parse(f"tinker://{RUN}/weights/half")
    # What a writer killed before its manifest leaves behind: payload files only.
    store.fs.makedirs(f"{store.dir_of(p)}/state", exist_ok=True)
    with store.fs.open(f"{store.dir_of(p)}/state/w.bin", "wb") as f:
        f.write(b"half")
    assert store.list(RUN) == [] and store.manifest(p) is None
    with pytest.raises(CheckpointNotFound):
        store.readable(str(p), "alice")
    store.commit(manifest(str(p)), payload(tmp_path), overwrite=False)  # no overwrite needed: nothing was there
    assert [m.tinker_path for m in store.list(RUN)] == [str(p)]


def test_expired_checkpoints_vanish_and_the_expiry_activity_deletes_only_a_matching_expiry(root, tmp_path):
    store = CheckpointStore(root)
    past = "2020-01-01T00:00:00Z"
    gone = f"tinker://{RUN}/weights/old"
    store.commit(manifest(gone, expires_at=past), payload(tmp_path), overwrite=False)
    assert store.list(RUN) == []
    with pytest.raises(CheckpointNotFound, match="expired"):
        store.readable(gone, "alice")

    activities = StorageActivities(store)
    assert not activities.delete_expired_checkpoint(gone, "2030-01-01T00:00:00Z")  # expiry moved: kept
    assert store.manifest(TinkerPath.parse(gone), include_expired=True) is not None
    assert activities.delete_expired_checkpoint(gone, past)
    assert store.manifest(TinkerPath.parse(gone), include_expired=True) is None
    assert not activities.delete_expired_checkpoint(gone, past)  # a retry finds nothing to do

    kept = f"tinker://{RUN}/weights/kept"
    store.commit(manifest(kept, expires_at=expiry_after(3600)), payload(tmp_path), overwrite=False)
    assert [m.tinker_path for m in store.list(RUN)] == [kept]


def test_claim_check_store_on_gcs(gcs):
    store = ClaimCheckStore(f"{gcs}/store")
    ref = store.put(b"tensor bytes", "requests")
    assert ref.uri.startswith("gs://") and store.get(ref) == b"tensor bytes"
    store.delete(ref)
    with pytest.raises(Exception, match="gone"):
        store.get(ref)


def test_signed_urls_verify_only_their_own_file_and_expiry():
    key = b"k" * 32
    expires = signed_urls.expiry()
    url = signed_urls.sign(key, "http://h:1/", f"tinker://{RUN}/external_weights/x", "adapter_config.json", expires)
    assert url.startswith("http://h:1/api/v1/checkpoint_files/sess-abc%3Atrain%3A0/external_weights/x/")
    sig = url.rsplit("signature=", 1)[1]
    path = f"tinker://{RUN}/external_weights/x"
    assert signed_urls.verify(key, path, "adapter_config.json", expires, sig)
    assert not signed_urls.verify(key, path, "adapter_model.safetensors", expires, sig)
    assert not signed_urls.verify(key, path, "adapter_config.json", expires + 1, sig)
    assert not signed_urls.verify(b"other", path, "adapter_config.json", expires, sig)
    assert not signed_urls.verify(key, path, "adapter_config.json", int(time.time()) - 1, sig)


@pytest.mark.parametrize("where", ["file", "gs"])
def test_the_claim_check_sweep_collects_only_old_objects(where, tmp_path, request):
    root = (tmp_path / "store").as_uri() if where == "file" else f"{request.getfixturevalue('gcs')}/sweep"
    store = ClaimCheckStore(root)
    old = store.put(b"old body", "requests")
    time.sleep(1.5)
    new = store.put(b"new body", "requests")
    result = store.put(b"result", "results")
    activities = StorageActivities(CheckpointStore((tmp_path / "c").as_uri()), store, retention_s=1.0)
    assert activities.sweep_claim_checks() == {"objects": 1, "bytes": len(b"old body")}
    with pytest.raises(Exception, match="gone"):
        store.get(old)
    assert store.get(new) == b"new body" and store.get(result) == b"result"
    assert StorageActivities(activities.checkpoints, store, retention_s=0).sweep_claim_checks()["objects"] == 0


def test_only_automatic_snapshots_are_deleted_as_internal(tmp_path):
    store = CheckpointStore((tmp_path / "c").as_uri())
    auto = f"tinker://{RUN}/auto_weights/latest"
    store.commit(manifest(auto), payload(tmp_path), overwrite=True)
    assert store.list(RUN) == []  # never listed ...
    with pytest.raises(CheckpointNotFound):  # ... nor loadable by a client
        store.readable(auto, "alice")
    activities = StorageActivities(store)
    with pytest.raises(ValueError, match="not an automatic snapshot"):
        activities.delete_internal_checkpoint(f"tinker://{RUN}/weights/a")
    assert activities.delete_internal_checkpoint(auto)
    assert store.manifest(TinkerPath.parse(auto)) is None
